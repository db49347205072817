"""Server-rendered pages of the catalog for people (Jinja2, no JavaScript), on the same services as the JSON routes."""
