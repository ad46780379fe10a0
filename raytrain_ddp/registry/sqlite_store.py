"""A sqlite tracking store opened while Ray starts (`opening_store`), and a new one made as a copy of
an empty database of this MLflow's schema, cached once per MLflow version, instead of running MLflow's
migrations for every new store."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from raytrain_ddp.registry.endpoint import is_server, mlflow_client, sqlite_file

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def opening_store(tracking_uri: str) -> Iterator[None]:
    """Open the tracking store in this process (MLflow keeps it) on a thread while the block runs: for
    a database, a second or two of imports, connecting and checking the schema, spent while Ray starts.
    A sqlite database that does not exist yet is made beside it under a hidden name (a copy of an
    empty one of MLflow's schema: `_new_database`), and `start_run` moves it into place once the run
    is accepted: a run refused before that leaves no database behind, and neither does a process that
    exits first. Errors are left to the calls that follow, which report them."""
    database = sqlite_file(tracking_uri)
    if database is not None and not database.exists() and database.parent.is_dir():
        target, new = _new_database, database.with_name(f".{database.name}.{os.getpid()}.new")
    elif is_server(tracking_uri) or database is not None and database.is_file():
        target, new = _open_store, None
    else:
        yield
        return

    thread = threading.Thread(target=target, args=(new or tracking_uri,), name="mlflow-open-store", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:  # the run refused: no database left behind
        thread.join()
        if new is not None:
            new.unlink(missing_ok=True)
        raise
    thread.join()
    if new is not None and new.is_file():
        _new_databases[tracking_uri] = new


_new_databases: dict[str, Path] = {}  # tracking URI -> its database, made by opening_store, not yet in place


def _open_store(tracking_uri: str) -> bool:
    """The store opened (True), or not: the calls that follow say why."""
    try:
        mlflow_client(tracking_uri).search_experiments(max_results=1)
    except Exception:  # noqa: BLE001
        return False
    return True


def _new_database(path: Path) -> None:
    """A new sqlite store at `path`: a copy of an empty one with this MLflow's schema, opened, MLflow
    adding what belongs to this store (its Default experiment, with artifacts beside it). Where no
    copy can be had, or it does not open, MLflow makes the store itself; failing that, it is left to
    MLflow to make, and start_run says what failed."""
    uri = f"sqlite:///{path}"
    if copy_empty_schema(path):
        if _open_store(uri):
            return
        _schema_file().unlink(missing_ok=True)  # not this MLflow's schema after all, or damaged: made again next time
        path.unlink(missing_ok=True)
    if not _open_store(uri):
        path.unlink(missing_ok=True)


def copy_empty_schema(path: Path) -> bool:
    """Make `path` a copy of an empty sqlite database of this MLflow's schema (`_empty_schema`), for
    MLflow to open as a new store without running its migrations. False where none can be had."""
    if (schema := _empty_schema()) is None:
        return False
    try:
        shutil.copyfile(schema, path)
    except OSError:
        path.unlink(missing_ok=True)
        return False
    return True


def _schema_file() -> Path:
    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raytrain_ddp"
    return cache / f"mlflow-{mlflow.__version__}-empty.db"


def _empty_schema() -> Path | None:
    """An empty sqlite database of this MLflow's schema, made once per MLflow version in the user's
    cache (`$XDG_CACHE_HOME`, else ~/.cache): MLflow makes a store's schema by running its ~60
    migrations, seconds on a small machine, which every new store paid. Made as MLflow's store makes it on an
    empty database (`_initialize_tables`), then moved into place whole. None where the cache cannot
    be written, or MLflow no longer makes a schema that way."""
    schema = _schema_file()
    if schema.is_file():
        return schema
    part = schema.with_name(f".{schema.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        from mlflow.store.db.utils import _initialize_tables, create_sqlalchemy_engine_with_retry

        schema.parent.mkdir(parents=True, exist_ok=True)
        engine = create_sqlalchemy_engine_with_retry(f"sqlite:///{part}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(part, schema)  # whole, or not at all: another driver's may land first, the same
    except Exception:  # noqa: BLE001 - no cache here (a read-only home, say): MLflow makes the store
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        return None
    return schema


def put_new_database_in_place(tracking_uri: str) -> None:
    """The database opening_store made for `tracking_uri`, under its own name: never over one made
    meanwhile (another driver's), and where a hard link cannot be made, left to MLflow to create."""
    new = _new_databases.pop(tracking_uri, None)
    if new is None:
        return
    try:
        os.link(new, sqlite_file(tracking_uri))
    except OSError:
        pass
    new.unlink(missing_ok=True)


def _discard_new_databases() -> None:
    """At exit, the databases opening_store made that no run took (a run refused after its plan)."""
    while _new_databases:
        _, new = _new_databases.popitem()
        new.unlink(missing_ok=True)


atexit.register(_discard_new_databases)
