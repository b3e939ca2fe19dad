"""Conversion library: detect a checkpoint's format, plan a kernel per layer for a target, and write
verified kernel-ready artifacts. Pure library (no FastAPI / Celery); entry points in `api.py`."""
