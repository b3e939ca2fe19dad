"""SQL metadata (SQLAlchemy 2): models, engine/session helpers and repository functions."""
