"""Every key of the job's store, spelled once: a constant for a fixed key, a small function for one
with a parameter. No other library module writes a key as a literal (tests/unit/test_house.py).

The store nests. Node 0's TCPStore (the *base*) is seen by each attempt of a self-spawned job,
or by each group of workers under torchrun, through a ``PrefixStore`` (the *job store* its
processes and supervisors use); the default process group and each session of the NCCL emulation
nest further. The whole key space, by prefix (``<x>``: a number or name; ``/``: a nested store):

    store       prefix                  keys under it
    base        bundle/config/          <node>: each node's settings (torchrun: each rank's, in
                                        its generation's job store)
                bundle/config-read/     <node>: that node has read every other node's settings
                bundle/hb/              <node>: heartbeat counters of the node supervisors
                bundle/arrived/         <name>: start-up barrier counters (also in a job store);
                                        between attempts <name> = bundle/attempt<n>/restart
                bundle/generation       the counter of torchrun's groups of workers
                bundle/hello/           <rank>: a torchrun worker's token
                bundle/welcome/         <token>: the generation that token was given
                bundle/gen<g>/          joined/<rank>; and generation g's job store /
                bundle/attempt<n>/      attempt n's job store /
    job store   bundle/abort            the job's first failure (a control key)
                bundle/lost_steps       steps trained again by the restarts so far
                bundle/done/            <node>: that node's workers finished
                bundle/clock/           <rank>/go, <rank>/ping<i>, <rank>/pong<i>: clock offsets
                bundle/arrived/         <name>: "start", "model built", "ready to train",
                                        ft/<epoch>/pg/<name>
                bundle/pg/              the default process group's store /
                ft/done                 training finished (--fault-tolerance bundle)
                ft/losses               bumped with every dead mark
                ft/dead/                <bundle>.<inc>: that incarnation is out (control key)
                ft/lost_node/           <node>: that node is silent, its bundles out (control)
                ft/healing/             <bundle>: its incarnation started last (control key)
                ft/join/                <bundle>.<inc>/in/<rank>, /count, /epoch: a heal
                ft/<epoch>/             in/<rank>, count/<bundle>, members: a loss agreed;
                                        pg/: that epoch's default group's store /
    default     nccl-emu/<n>/           session n of the NCCL emulation /
    group's     (in a session)          p2p/<src>><dst>/<n>/send|recv, coll/<ranks>/<rank>

No prefix is another's: each ends in ``/`` or is a whole key, ``bundle/gen<g>/`` takes digits
only (never ``bundle/generation``), and ``ft/<epoch>/`` digits only (never ``ft/done``, ``ft/dead/``
...); tests/unit/test_store_keys.py checks it on samples of every family.
"""

from __future__ import annotations

# -- the base store ------------------------------------------------------------------------------

# The prefixes of ``config``, ``config_read`` and ``arrived`` (``wait_joined`` waits under one).
CONFIG = "bundle/config"
CONFIG_READ = "bundle/config-read"
ARRIVED = "bundle/arrived"
# torchrun's rank 0 bumps it to number each group of workers; no one else reads it.
GENERATION = "bundle/generation"


# Each node's supervisor (torchrun: each rank) writes its settings; every peer reads them all.
def config(peer: int) -> str:
    return f"{CONFIG}/{peer}"


# Each peer writes it once it has read every other's settings; node 0 waits for them all.
def config_read(peer: int) -> str:
    return f"{CONFIG_READ}/{peer}"


# Every node's supervisor bumps its own; node 0's supervisor reads the others' (launch.nodes).
def heartbeat(node: int) -> str:
    return f"bundle/hb/{node}"


# Barrier ``name``'s counter: every process bumps it and polls it until all are there.
def arrived(name: str) -> str:
    return f"{ARRIVED}/{name}"


# The barrier name the nodes' supervisors meet at (base store) before the next attempt starts.
def restart_barrier(attempt_number: int) -> str:
    return f"{attempt(attempt_number)}/restart"


# A torchrun worker (rank > 0) writes its token; rank 0 reads it (runtime.store.open_generation).
def hello(rank: int) -> str:
    return f"bundle/hello/{rank}"


# Rank 0 writes the generation it gives ``token``; the worker that posted the token reads it.
def welcome(token: str) -> str:
    return f"bundle/welcome/{token}"


# A torchrun worker acknowledges its generation; rank 0 waits for every rank's.
def generation_joined(generation_number: int, rank: int) -> str:
    return f"{generation(generation_number)}/joined/{rank}"


# The prefix of attempt ``n``'s job store: its workers and supervisors write and read there.
def attempt(n: int) -> str:
    return f"bundle/attempt{n}"


# The prefix of torchrun generation ``g``'s job store: its workers write and read there.
def generation(g: int) -> str:
    return f"bundle/gen{g}"


# -- a job store (an attempt's or a generation's) -----------------------------------------------

# Whoever fails first writes it (post_abort, sealed); every worker and supervisor polls it.
ABORT = "bundle/abort"
# Node 0's supervisor writes it before an attempt starts; the trainer's summary reads it.
LOST_STEPS = "bundle/lost_steps"
# The prefix of the default process group's store (c10d's keys, the emulation's sessions).
GROUP = "bundle/pg"


# A node's supervisor writes it once its workers are done; node 0's waits for them all (nodes.py).
def done(node: int) -> str:
    return f"bundle/done/{node}"


# Rank 0 writes it when it is ready for ``rank``'s pings; ``rank`` waits for it (observe.trace).
def clock_go(rank: int) -> str:
    return f"bundle/clock/{rank}/go"


# ``rank`` writes its ``i``-th ping; rank 0 waits for it.
def clock_ping(rank: int, i: int) -> str:
    return f"bundle/clock/{rank}/ping{i}"


# Rank 0 writes its clock in answer to ping ``i``; ``rank`` reads it.
def clock_pong(rank: int, i: int) -> str:
    return f"bundle/clock/{rank}/pong{i}"


# -- --fault-tolerance bundle (bundle.launch.ft), in the job store --------------------------------

# The members write it when training finished; a new incarnation waiting to join reads it and ends.
FT_DONE = "ft/done"
# Bumped with every dead mark (mark_dead); the members' loss watch and the healers poll it.
FT_LOSSES = "ft/losses"


# A supervisor (its worker exited or froze) or a leaving process writes it; members read it.
def dead(bundle: int, incarnation: int = 0) -> str:
    return f"ft/dead/{bundle}.{incarnation}"


# Node 0's supervisor writes it for a silent node; the healers and ``wait_done`` read it.
def lost_node(node: int) -> str:
    return f"ft/lost_node/{node}"


# ``bundle``'s supervisors write the incarnation they started last; the members read it.
def healing(bundle: int) -> str:
    return f"ft/healing/{bundle}"


# The prefix under which the processes of ``bundle``'s ``incarnation`` ask to join.
def join(bundle: int, incarnation: int) -> str:
    return f"ft/join/{bundle}.{incarnation}"


# A process of the new incarnation writes it as it checks in; no one reads it back.
def join_in(bundle: int, incarnation: int, rank: int) -> str:
    return f"{join(bundle, incarnation)}/in/{rank}"


# Each process of the new incarnation bumps it; the members read it in their vote (``joining``).
def join_count(bundle: int, incarnation: int) -> str:
    return f"{join(bundle, incarnation)}/count"


# The members write the admission (compare-and-set); the new incarnation's processes wait for it.
def join_epoch(bundle: int, incarnation: int) -> str:
    return f"{join(bundle, incarnation)}/epoch"


def _epoch(epoch: int) -> str:
    return f"ft/{epoch}"


# Each survivor writes the steps it committed as it checks in to ``epoch``; the members compare.
def checked_in(epoch: int, rank: int) -> str:
    return f"{_epoch(epoch)}/in/{rank}"


# Each survivor of ``bundle`` bumps it as it checks in; every survivor reads all in ``_decide``.
def checked_in_count(epoch: int, bundle: int) -> str:
    return f"{_epoch(epoch)}/count/{bundle}"


# The first survivor to decide writes ``epoch``'s members (compare-and-set); every survivor reads.
def members(epoch: int) -> str:
    return f"{_epoch(epoch)}/members"


# The prefix of ``epoch``'s default process group's store (and of its start-up barriers' names).
def epoch_group(epoch: int) -> str:
    return f"{_epoch(epoch)}/pg"


# -- the NCCL emulation (bundle.collectives), in the default group's store ------------------------


# The prefix of the emulation's ``session``-th session in this process (each starts afresh).
def emulation(session: int) -> str:
    return f"nccl-emu/{session}"


# Each side of a point-to-point message writes its own once its call runs; the partner reads it
# and deletes it (``send``: the sending side's key).
def p2p(src: int, dst: int, n: int, *, send: bool) -> str:
    return f"p2p/{src}>{dst}/{n}/{'send' if send else 'recv'}"


# ``rank`` writes how many collectives it reached on the communicator of ``ranks`` ("world", or
# "0,2,4"); a stall report reads every member's.
def collective(ranks: str, rank: int) -> str:
    return f"coll/{ranks}/{rank}"
