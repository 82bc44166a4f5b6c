"""`dare server ARGS`: Prefect's `prefect server start ARGS`, kept from reaching the internet.

`dare server` (dare_core/cli.py) fills in dare.env before it starts this, and dare.env turns off
what Prefect's settings can (the server's telemetry heartbeat, the UI's analytics and promotional
content, the clients' analytics: see the file). One call has no setting: the route
`/collections/views/<view>` fetches Prefect's collection registry from raw.githubusercontent.com
(`prefect work-pool create` asks it for the known work pool types, the UI for its catalogs) and
falls back on the copy Prefect ships only when that fails. Here the shipped copy is the answer, and a
view Prefect ships none of is not found (the route's 404), as offline.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect.server.api import collections

SHIPPED = Path(collections.__file__).with_name("collections_data") / "views"


async def shipped_view(view: str) -> dict:
    path = SHIPPED / f"{view}.json"
    if not path.is_file():
        raise KeyError(view)  # the route answers 404: "View <view> not found in registry"
    return json.loads(path.read_text())


def main(argv: list[str]) -> None:
    # the route looks the function up in its module at each request
    collections.get_collection_view = shipped_view
    from prefect.cli import app

    sys.argv = ["prefect", "server", "start", *argv]
    app()


if __name__ == "__main__":
    main(sys.argv[1:])
