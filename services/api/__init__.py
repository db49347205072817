"""The REST API (FastAPI): thin routes over plain functions in services/."""
