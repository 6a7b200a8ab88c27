"""``rlfleet fleet``: the fleets running on a Ray cluster. A fleet outlives the driver that started it
(its controller and shards are detached actors), so this is how to see and stop one from a shell.

    rlfleet fleet list   [--address ADDR]         one JSON line per running fleet
    rlfleet fleet status NAME [--address ADDR]    its controller's status (gate, version, shards, restarts)
    rlfleet fleet stop   NAME [--address ADDR]    shut it down: every engine stopped, requests returned
"""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    fleet = sub.add_parser("fleet", help="list, inspect or stop the fleets running on a Ray cluster").add_subparsers(
        dest="fleet_command", required=True
    )
    for name, helptext, func in (("list", "list the running fleets", _cmd_list),
                                 ("status", "print a fleet's status", _cmd_status),
                                 ("stop", "shut a fleet down (every engine, then its controller)", _cmd_stop)):
        p = fleet.add_parser(name, help=helptext)
        if name != "list":
            p.add_argument("name", help="the fleet's name (its config's 'name', or fleet.name)")
        p.add_argument("--address", default=None, help="Ray cluster address (default: the running local one)")
        p.set_defaults(func=func)


def _cmd_list(args: argparse.Namespace) -> int:
    from rlfleet.fleet.cluster import ray_door

    ray_door.join_cluster(args.address)
    for name in ray_door.running_fleets():
        print(json.dumps({"fleet": name}))
    return 0


def _attach(args: argparse.Namespace):
    from rlfleet.fleet.api import Fleet

    return Fleet.connect(args.name, address=args.address)


def _cmd_status(args: argparse.Namespace) -> int:
    fleet = _attach(args)
    try:
        print(json.dumps(fleet.status(), default=str))
    finally:
        fleet.detach()
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    from rlfleet.fleet.api import this_process

    print(json.dumps(_attach(args).shutdown(by=f"`rlfleet fleet stop` ({this_process()})"), default=str))
    return 0
