"""Migration revisions, oldest first; each file is frozen once shipped."""
