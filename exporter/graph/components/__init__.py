"""Graph components that know nothing about any one architecture."""
