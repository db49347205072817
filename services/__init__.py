"""The farm service: API, catalog, object storage, scheduler."""
