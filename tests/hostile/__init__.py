"""Issue 16: broken and hostile inputs against every command (see docs/input-formats.md)."""
