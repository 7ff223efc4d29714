"""Storage backends: ``database`` (SQLite/PostgreSQL through SQLAlchemy Core), ``schema`` + ``migrations``
(alembic, applied at open), and the fsspec artifact store: :func:`open_database` and :class:`ArtifactStore` are the
package's public names.

Table modules of other concepts (declared on ``schema.metadata``) are registered below, so that any import of the
store sees the whole schema (the migration diff test, ``metadata.create_all`` in tools) without ``schema.py``
importing them back (an import circle).
"""

from . import (
    catalog_indexes,  # noqa: F401  (registers the run catalog's indexes on runs)
    control_tables,  # noqa: F401  (registers its tables on schema.metadata)
    plan_tables,  # noqa: F401  (registers its tables on schema.metadata)
    wait_tables,  # noqa: F401  (registers its tables on schema.metadata)
)
from .artifacts import ArtifactStore  # noqa: E402  (after the table registrations above)
from .database import Database, normalize_url, open_database  # noqa: E402

__all__ = ["ArtifactStore", "Database", "normalize_url", "open_database"]
