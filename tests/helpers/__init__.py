"""Test helpers shared across areas: synthetic checkpoint writers, error measures."""
