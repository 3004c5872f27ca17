"""``--executor local|ray`` and ``--ray-address``: one definition for the commands that can run on a Ray cluster."""

from __future__ import annotations

import click


def executor_options(what: str):
    """Decorate a command with the two options; ``what`` names the units of work that become Ray tasks."""

    def wrap(fn):
        fn = click.option("--ray-address", metavar="ADDR",
                          help="The Ray cluster to use with --executor ray: auto (a node of it), HOST:PORT or "
                          "ray://HOST:PORT (default: RAY_ADDRESS, else a new local instance).")(fn)
        return click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                            help=f"Where {what} run: here, in --jobs processes, or as Ray tasks (--jobs at a time) "
                            "on a Ray cluster; ray needs the extra: pip install 'ktconvert[ray]'.")(fn)

    return wrap
