#!/usr/bin/env bash
# Run this node's Bundle container on a Docker Swarm attachable overlay network.
#
# Every node runs this script once with its own rank; rank 0 creates the overlay network when it
# is missing (never removes one) and its container, named bundle-rank0, is the rendezvous master.
# The network is encrypted (IPsec between the nodes): the store and NCCL/gloo traffic have no
# encryption of their own, and an unencrypted overlay's VXLAN packets cross the hosts' network in
# clear text. Rank 0 refuses an existing network that is not encrypted, unless allowed to
# (--allow-unencrypted).
set -euo pipefail

readonly PROG=${0##*/}
readonly POSITIONAL_NAMES=(batch_size rank shape num_bundle world_size model data_path itr)

usage() {
  cat <<EOF
usage: $PROG [options] [batch_size rank shape num_bundle world_size model data_path itr] [-- main.py args...]
       $PROG [options] batch_size rank shape num_bundle IP portNum world_size model data_path itr [-- ...]

Runs one Bundle container for this node on an encrypted attachable overlay network. With no
positional arguments every value is asked on stdin.

positional arguments (all eight, in this order; or the original's ten, with IP and portNum):
  batch_size   global batch per step, over all bundles (positive integer)
  rank         rank of this node, 0 <= rank < world_size
  shape        bundle shape: replicas per stage, e.g. 1,1 or 4,2
  num_bundle   number of bundles (positive integer)
  IP, portNum  the master's address and port (ten-argument form; default bundle-rank0, --port)
  world_size   number of nodes (positive integer)
  model        model name, passed to --model
  data_path    absolute path of an existing data directory, mounted read-only at /data
  itr          number of training steps (positive integer)

options (before the positional arguments; each also read from the environment variable shown):
  --image IMAGE      container image                 [BUNDLE_IMAGE, default bundle:latest]
  --network NAME     encrypted attachable overlay    [BUNDLE_NETWORK, default bundle-net]
  --subnet CIDR      subnet of a network rank 0 creates [BUNDLE_SUBNET, default 10.10.0.0/16]
  --port PORT        rendezvous port on rank 0       [BUNDLE_PORT, default 29500]
  --gpus VALUE       value of docker run --gpus; none omits the flag [BUNDLE_GPUS, default all]
  --allow-unencrypted
                     let rank 0 use an existing network made without --opt encrypted
                     (rank 0 refuses it otherwise)   [BUNDLE_ALLOW_UNENCRYPTED=1, default 0]
  --dry-run          print the docker commands instead of running them
  -h, --help         show this help
  -- ARGS...         extra main.py arguments, appended after BUNDLE_EXTRA_ARGS (split on spaces)

example:
  $PROG 32 1 4,2 1 2 resnet50 /home/me/ImageNet 100 -- --backend nccl
EOF
}

die_usage() {
  printf '%s: error: %s\n' "$PROG" "$1" >&2
  usage >&2
  exit 2
}

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
is_posint() { [[ $1 =~ ^[0-9]+$ ]] && ((10#$1 > 0)); }

image=${BUNDLE_IMAGE:-bundle:latest}
network=${BUNDLE_NETWORK:-bundle-net}
subnet=${BUNDLE_SUBNET:-10.10.0.0/16}
port=${BUNDLE_PORT:-29500}
gpus=${BUNDLE_GPUS:-all}
allow_unencrypted=${BUNDLE_ALLOW_UNENCRYPTED:-0}
dry_run=0
master=""
extra=()
if [[ -n ${BUNDLE_EXTRA_ARGS:-} ]]; then
  read -r -a extra <<<"$BUNDLE_EXTRA_ARGS"
fi

need_value() {
  [[ $# -ge 2 && -n $2 ]] || die_usage "option $1 needs a value"
}

while [[ $# -gt 0 ]]; do
  case $1 in
    --image) need_value "$@"; image=$2; shift 2 ;;
    --network) need_value "$@"; network=$2; shift 2 ;;
    --subnet) need_value "$@"; subnet=$2; shift 2 ;;
    --port) need_value "$@"; port=$2; shift 2 ;;
    --gpus) need_value "$@"; gpus=$2; shift 2 ;;
    --allow-unencrypted) allow_unencrypted=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) break ;;
    -?*) die_usage "unknown option $1" ;;
    *) break ;;
  esac
done

positionals=()
while [[ $# -gt 0 && $1 != -- ]]; do
  positionals+=("$1")
  shift
done
if [[ $# -gt 0 ]]; then
  shift # the --
  extra+=("$@")
fi

# ask VAR PROMPT [DEFAULT]: the original script's interactive mode, one answer per line.
ask() {
  local answer="" prompt=$2
  [[ -n ${3:-} ]] && prompt+=" [$3]"
  read -r -p "$prompt: " answer || true
  printf -v "$1" '%s' "${answer:-${3:-}}"
}

if [[ ${#positionals[@]} -eq 0 ]]; then
  ask batch_size "global batch size (all bundles)" 32
  ask rank "rank of this node" 0
  ask shape "bundle shape (replicas per stage)" 1,1
  ask num_bundle "number of bundles" 1
  ask world_size "number of nodes (world size)" 1
  ask model "model name" resnet50
  ask data_path "absolute path of the data directory"
  ask itr "number of training steps" 100
elif [[ ${#positionals[@]} -eq 10 ]]; then
  # The original README's usage line: the master's IP and port after num_bundle.
  batch_size=${positionals[0]} rank=${positionals[1]} shape=${positionals[2]}
  num_bundle=${positionals[3]} master=${positionals[4]} port=${positionals[5]}
  world_size=${positionals[6]} model=${positionals[7]} data_path=${positionals[8]}
  itr=${positionals[9]}
elif [[ ${#positionals[@]} -ne ${#POSITIONAL_NAMES[@]} ]]; then
  die_usage "expected ${#POSITIONAL_NAMES[@]} (or 10) positional arguments, got ${#positionals[@]}"
else
  batch_size=${positionals[0]} rank=${positionals[1]} shape=${positionals[2]}
  num_bundle=${positionals[3]} world_size=${positionals[4]} model=${positionals[5]}
  data_path=${positionals[6]} itr=${positionals[7]}
fi
master=${master:-bundle-rank0}

for name in batch_size num_bundle world_size itr; do
  is_posint "${!name}" || die_usage "$name must be a positive integer, got '${!name}'"
done
is_uint "$rank" || die_usage "rank must be a non-negative integer, got '$rank'"
((10#$rank < 10#$world_size)) || die_usage "rank must be < world_size ($world_size), got $rank"
rank=$((10#$rank))
[[ $shape =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] \
  || die_usage "shape must be positive integers separated by commas (e.g. 4,2), got '$shape'"
[[ -n $model && $model != -* && $model =~ ^[^[:space:]]+$ ]] \
  || die_usage "model must be a non-empty name without spaces, got '$model'"
[[ $data_path == /* ]] || die_usage "data_path must be an absolute path, got '$data_path'"
[[ -d $data_path ]] || die_usage "data_path must be an existing directory, got '$data_path'"
[[ $data_path != *:* ]] || die_usage "data_path must not contain ':', got '$data_path'"
if ! is_posint "$port" || ((10#$port > 65535)); then
  die_usage "port must be in 1..65535, got '$port'"
fi
[[ $network =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || die_usage "bad network name '$network'"
[[ $subnet =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}/[0-9]{1,2}$ ]] \
  || die_usage "subnet must be an IPv4 CIDR such as 10.10.0.0/16, got '$subnet'"
[[ -n $image && $image =~ ^[^[:space:]]+$ ]] || die_usage "bad image '$image'"
[[ $gpus =~ ^[^[:space:]]+$ ]] || die_usage "bad --gpus value '$gpus'"
[[ $master =~ ^[A-Za-z0-9][A-Za-z0-9_.:-]*$ ]] || die_usage "bad IP '$master'"
[[ $allow_unencrypted =~ ^[01]$ ]] \
  || die_usage "BUNDLE_ALLOW_UNENCRYPTED must be 0 or 1, got '$allow_unencrypted'"

readonly name=bundle-rank${rank}

# The docker flag order is fixed (tests/integration/test_containers.py compares the command):
#   run --rm --name --hostname --network --ipc=host [--gpus] -e BUNDLE_SUBNET -v DATA:/data:ro
# --ipc=host gives PyTorch's shared-memory tensors (DataLoader workers) the host's /dev/shm.
run_cmd=(docker run --rm --name "$name" --hostname "$name" --network "$network" --ipc=host)
[[ $gpus == none ]] || run_cmd+=(--gpus "$gpus")
run_cmd+=(-e "BUNDLE_SUBNET=$subnet" -v "$data_path:/data:ro" "$image")
run_cmd+=(--batch-size "$batch_size" --rank "$rank" --bundle-shape "$shape")
run_cmd+=(--num-bundle "$num_bundle" --world-size "$world_size" --model "$model" --itr "$itr")
run_cmd+=(--IP "$master" --portNum "$port" /data ${extra[@]+"${extra[@]}"})

# The network's option names, one a line. `{{index .Options "encrypted"}}` cannot tell a network
# made with `--opt encrypted` (value "") from one without it, and the overlay driver encrypts
# whenever the name is present, whatever its value.
# shellcheck disable=SC2016 # a Go template for docker, not a shell expansion
readonly OPTION_NAMES='{{range $k, $v := .Options}}{{println $k}}{{end}}'
inspect_cmd=(docker network inspect --format "$OPTION_NAMES" "$network")
# Attachable: `docker run --network` (below) joins only attachable overlays.
create_cmd=(docker network create --driver overlay --attachable --opt encrypted
  --subnet "$subnet" "$network")

# Words of a command, space separated, single-quoted only where the shell needs it (--dry-run).
quoted() {
  local word out=() q="'"
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
      out+=("$word")
    else
      out+=("$q${word//$q/$q\\$q$q}$q")
    fi
  done
  printf '%s' "${out[*]}"
}

if ((dry_run)); then
  if ((rank == 0)); then
    printf '%s >/dev/null 2>&1 || %s\n' "$(quoted "${inspect_cmd[@]}")" "$(quoted "${create_cmd[@]}")"
  fi
  printf '%s\n' "$(quoted "${run_cmd[@]}")"
  exit 0
fi

command -v docker >/dev/null 2>&1 || { echo "$PROG: docker not found on PATH" >&2; exit 1; }

# An existing network must carry the encrypted option, or be allowed without it.
check_encrypted() {
  local names=$1
  [[ $'\n'$names$'\n' == *$'\n'encrypted$'\n'* ]] && return 0
  if ((allow_unencrypted)); then
    printf '%s: warning: overlay network %s is not encrypted; using it as it is (%s)\n' \
      "$PROG" "$network" "--allow-unencrypted" >&2
    return 0
  fi
  local recreate="docker network rm $network, then run this again (it adds --opt encrypted)"
  printf '%s: error: overlay network %s is not encrypted (%s); to recreate it: %s; or pass %s\n' \
    "$PROG" "$network" "the job's traffic would cross between nodes in clear text" "$recreate" \
    "--allow-unencrypted (BUNDLE_ALLOW_UNENCRYPTED=1) to use it as it is" >&2
  exit 2
}

if ((rank == 0)); then
  if option_names=$("${inspect_cmd[@]}" 2>/dev/null); then
    check_encrypted "$option_names"
  else
    echo "$PROG: creating encrypted overlay network $network ($subnet)" >&2
    "${create_cmd[@]}" >/dev/null || {
      echo "$PROG: could not create $network; is this node a swarm manager (docker swarm init)?" >&2
      exit 1
    }
  fi
fi

echo "$PROG: starting $name (master $master:$port) on $network" >&2
exec "${run_cmd[@]}"
