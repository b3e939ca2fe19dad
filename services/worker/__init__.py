"""Job execution edges: the Celery app and task, the embedded worker, the reconciler."""
