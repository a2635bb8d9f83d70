"""paddle."""
