"""alembic environment for smthrs_plugin's store.

At runtime ``stores/migrate.py`` passes an open connection (inside the transaction that holds the migration
lock) through ``config.attributes["connection"]``; alembic then joins that transaction. From a checkout, the
alembic CLI works too: ``alembic -c smthrs_plugin/stores/migrations/alembic.ini -x url=sqlite:///x.db upgrade
heads`` (or ``revision -m "add waits"`` to start a new migration file).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from smthrs_plugin.stores.migrate import VERSION_TABLE
from smthrs_plugin.stores.schema import metadata

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        # SQLite DDL is transactional too; declare it so the whole upgrade is one unit on both backends.
        transactional_ddl=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("pass the database with: alembic -x url=sqlite:///path/state.db ...")
    engine = create_engine(url)
    with engine.connect() as conn:
        _run(conn)
        conn.commit()
