#!/usr/bin/env bash
# Container entrypoint: pin NCCL/gloo to the overlay interface, then exec main.py.
#
# Why: a container on a Swarm overlay has several interfaces (the overlay, docker_gwbridge, ...)
# and NCCL/gloo may pick one the peers cannot reach, which shows up as a hang at the first
# collective. The interface holding an address on BUNDLE_SUBNET is the one the peers share.
#
# Environment:
#   NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME  kept as they are when already set
#   BUNDLE_SUBNET        IPv4 CIDR of the overlay network (e.g. 10.10.0.0/16); when unset the
#                        first non-loopback interface with an IPv4 address is used
#   BUNDLE_ROUTE_FILE    route table read when `ip` is missing or fails (default: /proc/net/route)
#
# What runs is fixed: `ip -o -4 addr show` (when `ip` exists), then `python` on the main.py in
# the folder above this script's (/app/main.py in the image). No BUNDLE_ variable names a command
# (PATH still finds `python`, as for any image's command): on a shared cluster whoever may set a
# pod's environment (a ConfigMap, say) must not thereby choose what the image executes. The
# former test hooks BUNDLE_IP_ADDR_CMD, BUNDLE_PYTHON and BUNDLE_MAIN are ignored, with a warning.
set -euo pipefail

readonly IGNORED_VARIABLES=(BUNDLE_IP_ADDR_CMD BUNDLE_PYTHON BUNDLE_MAIN)

log() {
  printf '[entrypoint] %s\n' "$*" >&2
}

# Dotted quad -> 32-bit integer; fails on anything that is not four octets 0-255.
ip_to_int() {
  local a b c d extra
  IFS=. read -r a b c d extra <<<"$1"
  local octet
  for octet in "$a" "$b" "$c" "$d"; do
    [[ $octet =~ ^[0-9]{1,3}$ ]] && ((10#$octet <= 255)) || return 1
  done
  [[ -z $extra ]] || return 1
  echo $(((10#$a << 24) | (10#$b << 16) | (10#$c << 8) | 10#$d))
}

prefix_to_mask() {
  local len=$1
  if ((len == 0)); then
    echo 0
  else
    echo $(((0xFFFFFFFF << (32 - len)) & 0xFFFFFFFF))
  fi
}

# Sets SUBNET_NET and SUBNET_MASK from BUNDLE_SUBNET; returns 1 when it is not an IPv4 CIDR.
parse_subnet() {
  local cidr=$1 addr len net
  [[ $cidr =~ ^([0-9.]+)/([0-9]{1,2})$ ]] || return 1
  addr=${BASH_REMATCH[1]}
  len=$((10#${BASH_REMATCH[2]}))
  ((len <= 32)) || return 1
  net=$(ip_to_int "$addr") || return 1
  SUBNET_MASK=$(prefix_to_mask "$len")
  SUBNET_NET=$((net & SUBNET_MASK))
}

in_subnet() {
  local ip_int
  ip_int=$(ip_to_int "$1") || return 1
  (((ip_int & SUBNET_MASK) == SUBNET_NET))
}

# Lines of `ip -o -4 addr show`: "2: eth0    inet 10.10.0.5/16 brd ... scope global eth0 ...".
ip_addr_lines() {
  command -v ip >/dev/null 2>&1 || return 1
  ip -o -4 addr show
}

# Interface from `ip -o -4 addr` output: the one on the subnet, else the first non-loopback one.
pick_from_ip_addr() {
  local _idx ifname family cidr _rest
  while read -r _idx ifname family cidr _rest; do
    [[ $family == inet && $ifname != lo ]] || continue
    ifname=${ifname%%@*}
    if [[ -z ${SUBNET_NET:-} ]] || in_subnet "${cidr%%/*}"; then
      echo "$ifname"
      return 0
    fi
  done
  return 1
}

# /proc/net/route stores addresses as host-order (little-endian) hex: 00000A0A is 10.10.0.0.
route_hex_to_int() {
  local h=$1
  [[ $h =~ ^[0-9A-Fa-f]{8}$ ]] || return 1
  echo $(((16#${h:6:2} << 24) | (16#${h:4:2} << 16) | (16#${h:2:2} << 8) | 16#${h:0:2}))
}

# Interface from the route table: the one routing (part of) the subnet, else the first non-loopback
# one. Used when the image has no iproute2, which the stock PyTorch runtime images lack.
pick_from_route() {
  local file=$1 ifname dest _gw _flags _refcnt _use _metric mask _rest dest_int mask_int
  [[ -r $file ]] || return 1
  while read -r ifname dest _gw _flags _refcnt _use _metric mask _rest; do
    [[ $ifname != Iface && $ifname != lo ]] || continue
    if [[ -z ${SUBNET_NET:-} ]]; then
      echo "$ifname"
      return 0
    fi
    dest_int=$(route_hex_to_int "$dest") || continue
    mask_int=$(route_hex_to_int "$mask") || continue
    # A route inside the subnet (at least as specific) means the interface sits on it.
    if (((mask_int & SUBNET_MASK) == SUBNET_MASK && (dest_int & SUBNET_MASK) == SUBNET_NET)); then
      echo "$ifname"
      return 0
    fi
  done <"$file"
  return 1
}

pick_interface() {
  local lines
  if lines=$(ip_addr_lines 2>/dev/null); then
    pick_from_ip_addr <<<"$lines"
  else
    pick_from_route "${BUNDLE_ROUTE_FILE:-/proc/net/route}"
  fi
}

choose_socket_ifname() {
  if [[ -n ${NCCL_SOCKET_IFNAME:-} && -n ${GLOO_SOCKET_IFNAME:-} ]]; then
    log "socket interface preset: NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME"
    return 0
  fi

  SUBNET_NET=
  local ifname="" why
  if [[ -n ${BUNDLE_SUBNET:-} ]]; then
    if ! parse_subnet "$BUNDLE_SUBNET"; then
      log "error: BUNDLE_SUBNET='$BUNDLE_SUBNET' is not an IPv4 CIDR such as 10.10.0.0/16"
      exit 2
    fi
    if ifname=$(pick_interface); then
      why="holds an address on BUNDLE_SUBNET=$BUNDLE_SUBNET"
    else
      log "warning: no interface on BUNDLE_SUBNET=$BUNDLE_SUBNET; falling back to the first one"
      SUBNET_NET=
    fi
  fi
  if [[ -z $ifname ]] && ifname=$(pick_interface); then
    why="first non-loopback interface with IPv4"
  fi
  if [[ -z $ifname ]]; then
    log "warning: no non-loopback IPv4 interface found; leaving NCCL/gloo to choose"
    return 0
  fi

  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$ifname}"
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$ifname}"
  log "socket interface $ifname ($why): NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME"
}

warn_ignored_variables() {
  local name
  for name in "${IGNORED_VARIABLES[@]}"; do
    if [[ -n ${!name+set} ]]; then
      log "warning: $name is not read (it named a command to run); ignored"
    fi
  done
}

# The folder above this script's, from where the script lives (not from the environment):
# /app in the image, the checkout when a test runs the script in place.
app_dir() {
  local here=${BASH_SOURCE[0]%/*}
  [[ $here != "${BASH_SOURCE[0]}" ]] || here=.
  CDPATH='' cd -P -- "$here/.." && pwd -P
}

warn_ignored_variables
choose_socket_ifname
main=$(app_dir)/main.py
exec python "$main" "$@"
