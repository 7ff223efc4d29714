"""Storage backends: ``database`` (SQLite/PostgreSQL through SQLAlchemy Core), ``schema`` + ``migrations``
(alembic, applied at open), and the fsspec artifact store: :func:`open_database` and :class:`ArtifactStore` are the
package's public names.

Table modules of other concepts (declared on ``schema.metadata``) are registered below, so that any import of the
store sees the whole schema (the migration diff test, ``metadata.create_all`` in tools) without ``_schema.py``
importing them back (an import circle).
"""

from . import (
    _catalog_indexes,  # noqa: F401  (registers the run catalog's indexes on runs)
    _control_tables,  # noqa: F401  (registers its tables on schema.metadata)
    _plan_tables,  # noqa: F401  (registers its tables on schema.metadata)
    _wait_tables,  # noqa: F401  (registers its tables on schema.metadata)
)
from ._artifacts import ArtifactStore  # noqa: E402  (after the table registrations above)
from ._database import Database, normalize_url, open_database  # noqa: E402

__all__ = ["ArtifactStore", "Database", "normalize_url", "open_database"]
