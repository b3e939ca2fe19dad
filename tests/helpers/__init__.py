"""Test helpers shared across areas: error measures (checkpoint writers: devtools/builders)."""
