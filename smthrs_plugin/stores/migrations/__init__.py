"""alembic migrations of the smthrs store (see README beside this file); applied by ``open_database``."""
