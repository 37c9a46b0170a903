"""bundle/runtime/keys.py: every key of the job's store is spelled as its map says, every name of
the module is spelled here, and no two families of keys collide (a key of one is never a key of
another, nor under another's prefix)."""

from __future__ import annotations

import re
import types
import uuid

import pytest

from bundle.runtime import keys

TOKEN = uuid.uuid4().hex

# Each name of the keys module: what it gives for some parameters, and the string expected.
SPELLED: dict[str, list[tuple[str, str]]] = {
    "CONFIG": [(keys.CONFIG, "bundle/config")],
    "CONFIG_READ": [(keys.CONFIG_READ, "bundle/config-read")],
    "ARRIVED": [(keys.ARRIVED, "bundle/arrived")],
    "GENERATION": [(keys.GENERATION, "bundle/generation")],
    "GROUP": [(keys.GROUP, "bundle/pg")],
    "config": [(keys.config(3), "bundle/config/3")],
    "config_read": [(keys.config_read(0), "bundle/config-read/0")],
    "heartbeat": [(keys.heartbeat(2), "bundle/hb/2")],
    "arrived": [(keys.arrived("model built"), "bundle/arrived/model built")],
    "restart_barrier": [(keys.restart_barrier(1), "bundle/attempt1/restart")],
    "hello": [(keys.hello(5), "bundle/hello/5")],
    "welcome": [(keys.welcome("ab12"), "bundle/welcome/ab12")],
    "generation_joined": [(keys.generation_joined(4, 2), "bundle/gen4/joined/2")],
    "attempt": [(keys.attempt(0), "bundle/attempt0")],
    "generation": [(keys.generation(12), "bundle/gen12")],
    "ABORT": [(keys.ABORT, "bundle/abort")],
    "LOST_STEPS": [(keys.LOST_STEPS, "bundle/lost_steps")],
    "done": [(keys.done(1), "bundle/done/1")],
    "clock_go": [(keys.clock_go(3), "bundle/clock/3/go")],
    "clock_ping": [(keys.clock_ping(3, 7), "bundle/clock/3/ping7")],
    "clock_pong": [(keys.clock_pong(3, 7), "bundle/clock/3/pong7")],
    "FT_DONE": [(keys.FT_DONE, "ft/done")],
    "FT_LOSSES": [(keys.FT_LOSSES, "ft/losses")],
    "dead": [(keys.dead(1), "ft/dead/1.0"), (keys.dead(2, 3), "ft/dead/2.3")],
    "lost_node": [(keys.lost_node(1), "ft/lost_node/1")],
    "healing": [(keys.healing(2), "ft/healing/2")],
    "join": [(keys.join(1, 2), "ft/join/1.2")],
    "join_in": [(keys.join_in(1, 2, 5), "ft/join/1.2/in/5")],
    "join_count": [(keys.join_count(1, 2), "ft/join/1.2/count")],
    "join_epoch": [(keys.join_epoch(1, 2), "ft/join/1.2/epoch")],
    "checked_in": [(keys.checked_in(1, 4), "ft/1/in/4")],
    "checked_in_count": [(keys.checked_in_count(1, 2), "ft/1/count/2")],
    "members": [(keys.members(3), "ft/3/members")],
    "epoch_group": [(keys.epoch_group(0), "ft/0/pg")],
    "emulation": [(keys.emulation(2), "nccl-emu/2")],
    "p2p": [
        (keys.p2p(0, 2, 5, send=True), "p2p/0>2/5/send"),
        (keys.p2p(2, 0, 1, send=False), "p2p/2>0/1/recv"),
    ],
    "collective": [
        (keys.collective("world", 1), "coll/world/1"),
        (keys.collective("0,2", 2), "coll/0,2/2"),
    ],
}


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_each_key_is_spelled_as_its_map_says(name):
    for got, expected in SPELLED[name]:
        assert got == expected


def test_every_name_of_the_keys_module_is_spelled_here():
    public = {
        name
        for name, value in vars(keys).items()
        if not name.startswith("_") and isinstance(value, str | types.FunctionType)
    }
    assert public == set(SPELLED)


# Every family of keys, as a pattern a key of it matches whole, and samples of it from the keys
# module (a prefix of a nested store: a key under it). ``.+`` under a prefix: any key there.
N = (0, 1, 7, 12)
FAMILIES: dict[str, tuple[str, list[str]]] = {
    "config": (r"bundle/config/\d+", [keys.config(i) for i in N]),
    "config-read": (r"bundle/config-read/\d+", [keys.config_read(i) for i in N]),
    "heartbeat": (r"bundle/hb/\d+", [keys.heartbeat(i) for i in N]),
    "arrived": (
        r"bundle/arrived/.+",
        [keys.arrived("start"), keys.arrived(keys.restart_barrier(3))]
        + [keys.arrived(f"{keys.epoch_group(i)}/ready to train") for i in N],
    ),
    "generation counter": (r"bundle/generation", [keys.GENERATION]),
    "hello": (r"bundle/hello/\d+", [keys.hello(i) for i in N]),
    "welcome": (r"bundle/welcome/[0-9a-f]+", [keys.welcome(TOKEN)]),
    "a generation": (
        r"bundle/gen\d+/.+",
        [keys.generation_joined(i, 1) for i in N] + [f"{keys.generation(i)}/x" for i in N],
    ),
    "an attempt": (r"bundle/attempt\d+/.+", [f"{keys.attempt(i)}/{keys.ABORT}" for i in N]),
    "abort": (r"bundle/abort", [keys.ABORT]),
    "lost steps": (r"bundle/lost_steps", [keys.LOST_STEPS]),
    "done": (r"bundle/done/\d+", [keys.done(i) for i in N]),
    "clock": (
        r"bundle/clock/\d+/(go|ping\d+|pong\d+)",
        [f(r, i) for r in N for i in N for f in (keys.clock_ping, keys.clock_pong)]
        + [keys.clock_go(r) for r in N],
    ),
    "the default group": (r"bundle/pg/.+", [f"{keys.GROUP}/x"]),
    "ft done": (r"ft/done", [keys.FT_DONE]),
    "ft losses": (r"ft/losses", [keys.FT_LOSSES]),
    "dead": (r"ft/dead/\d+\.\d+", [keys.dead(b, i) for b in N for i in N]),
    "lost node": (r"ft/lost_node/\d+", [keys.lost_node(i) for i in N]),
    "healing": (r"ft/healing/\d+", [keys.healing(i) for i in N]),
    "join": (
        r"ft/join/\d+\.\d+/(in/\d+|count|epoch)",
        [f(b, i) for b in N for i in N for f in (keys.join_count, keys.join_epoch)]
        + [keys.join_in(b, i, 3) for b in N for i in N],
    ),
    "an epoch": (
        r"ft/\d+/(in/\d+|count/\d+|members|pg/.+)",
        [f(e, i) for e in N for i in N for f in (keys.checked_in, keys.checked_in_count)]
        + [keys.members(e) for e in N]
        + [f"{keys.epoch_group(e)}/x" for e in N],
    ),
    "an emulation session": (r"nccl-emu/\d+/.+", [f"{keys.emulation(i)}/x" for i in N]),
    "p2p": (
        r"p2p/\d+>\d+/\d+/(send|recv)",
        [keys.p2p(a, b, i, send=s) for a in N for b in N for i in N for s in (True, False)],
    ),
    "collective": (
        r"coll/(world|\d+(,\d+)*)/\d+",
        [keys.collective(w, r) for w in ("world", "0", "0,2,4") for r in N],
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_key_of_one_family_is_a_key_of_no_other(family):
    pattern, samples = FAMILIES[family]
    others = {f: p for f, (p, _) in FAMILIES.items() if f != family}
    for key in samples:
        assert re.fullmatch(pattern, key), (family, key)
        assert [f for f, p in others.items() if re.fullmatch(p, key)] == [], key


def test_the_map_names_every_family():
    """Each family's fixed head (its pattern up to the first parameter) is in the module's map."""
    doc = keys.__doc__ or ""
    heads = {f: re.split(r"\\d|\(|\.\+|\[", p)[0] for f, (p, _) in FAMILIES.items()}
    assert [f"{f}: {h}" for f, h in heads.items() if h not in doc] == []
