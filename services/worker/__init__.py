"""Job execution: one job's run (jobs.py), the Celery app (celery_app.py, a leaf), the worker's entry
point and task (app.py, tasks.py), the dispatchers, the embedded worker and the reconciler."""
