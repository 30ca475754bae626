#!/usr/bin/env bash
# A one-node SLURM cluster on this Debian or Ubuntu machine, for tests/test_slurm.py (run as root):
# munge, a private MariaDB, slurmdbd (so that sacct and sacctmgr answer), slurmctld and slurmd; select/cons_tres,
# proctrack/linuxproc, no cgroups. There is no systemd here: every daemon runs in the foreground in a session of
# its own, its pid recorded in $CLEANMISL_SLURM_DIR/pid/<daemon>.pid, and --stop stops those pids and nothing else.
#
#   .ci/slurm_up.sh          install what is missing (apt-get), write the configuration, start what is not running
#   .ci/slurm_up.sh --stop   cancel the cluster's jobs, stop the daemons this script started (also .ci/slurm_down.sh)
#
# Running it again is harmless: a daemon already running is left alone, unless its configuration changed, and the
# cluster's account and users are added once. It refuses to overwrite a slurm.conf or slurmdbd.conf it did not write.
# The cluster is tuned for short tests: KillWait 5 s, no OverTimeLimit, the scheduler every 2 s, a requeued job
# eligible again after 10 s (the credential lifetime), partition `ci` with feature `ci` on the one node.
set -euo pipefail

DIR=${CLEANMISL_SLURM_DIR:-/var/lib/cleanmisl-slurm}
CLUSTER=cleanmisl-ci
MARK="# written by cleanmisl's .ci/slurm_up.sh"
ETC=/etc/slurm
DB_PORT=3307  # the private MariaDB, on 127.0.0.1 only: a MariaDB of the machine's own (3306) is left alone
DB_PASS=cleanmisl-ci
SOCKET=$DIR/run/mysqld.sock

say() { echo "slurm_up: $*"; }
die() { echo ".ci/slurm_up.sh: error: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run it as root (it installs packages and starts daemons)"

# ---------------------------------------------------------------- processes by their recorded pid
recorded() {  # the pid recorded for daemon $1 if that process still runs as $1, else nothing
  local file=$DIR/pid/$1.pid pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if [[ $pid =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${1:0:15}" ]; then
    echo "$pid"
  fi
}

start() {  # start daemon $1 as the command that follows, in the foreground of a session of its own
  local name=$1
  shift
  mkdir -p "$DIR/pid" "$DIR/log"
  # in a script (no job control) a background job is no process-group leader, so setsid execs without a fork:
  # $! is the daemon itself
  setsid "$@" >> "$DIR/log/$name.out" 2>&1 < /dev/null &
  echo $! > "$DIR/pid/$name.pid"
  say "started $name (pid $!)"
}

stop() {  # stop the daemon recorded for $1: SIGTERM, SIGKILL if it still runs 30 s later
  local pid
  pid=$(recorded "$1")
  if [ -n "$pid" ]; then
    kill -TERM "$pid" 2> /dev/null || true
    for _ in $(seq 300); do
      [ -d "/proc/$pid" ] || break
      sleep 0.1
    done
    if [ -d "/proc/$pid" ]; then
      kill -KILL "$pid" 2> /dev/null || true
    fi
    say "stopped $1 (pid $pid)"
  fi
  rm -f "$DIR/pid/$1.pid"
}

wait_for() {  # wait_for WHAT SECONDS COMMAND...: until COMMAND succeeds
  local what=$1 seconds=$2
  shift 2
  for _ in $(seq $((seconds * 5))); do
    if "$@" > /dev/null 2>&1; then
      return 0
    fi
    sleep 0.2
  done
  die "$what did not come up within $seconds s; see $DIR/log/"
}

ours() {  # whether file $1 is missing or was written by this script
  [ ! -e "$1" ] || grep -qxF "$MARK" "$1"
}

# ---------------------------------------------------------------- --stop
stop_all() {
  if [ -n "$(recorded slurmctld)" ]; then
    local jobs
    jobs=$(squeue -h -o %A 2> /dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      # shellcheck disable=SC2086
      scancel $jobs 2> /dev/null || true
      for _ in $(seq 100); do  # their processes end within KillWait (5 s)
        [ -z "$(squeue -h -t running,completing,configuring -o %A 2> /dev/null)" ] && break
        sleep 0.2
      done
      say "cancelled the jobs $jobs"
    fi
  fi
  for daemon in slurmd slurmctld slurmdbd mariadbd munged; do
    stop "$daemon"
  done
}

case "${1:-}" in
  --stop)
    stop_all
    exit 0
    ;;
  "") ;;
  *) die "unknown argument '$1'; use no argument to start the cluster, --stop to stop it" ;;
esac

# ---------------------------------------------------------------- packages
missing=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client slurmdbd:slurmdbd munged:munge \
            mariadbd:mariadb-server; do
  command -v "${pair%%:*}" > /dev/null || [ -x "/usr/sbin/${pair%%:*}" ] || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  # no package may start its service while it installs (there is no init system to start it properly here)
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client slurmdbd munge mariadb-server > /dev/null
  rm -f /usr/sbin/policy-rc.d
  trap - EXIT
fi
export PATH=$PATH:/usr/sbin:/sbin

# ---------------------------------------------------------------- configuration
ours "$ETC/slurm.conf" || die "$ETC/slurm.conf was not written by this script: this machine has a SLURM of its own"
ours "$ETC/slurmdbd.conf" || die "$ETC/slurmdbd.conf was not written by this script"
mkdir -p "$DIR"/{pid,log,run,state,spool} "$ETC"
HOST=$(hostname -s)
# the node as slurmd sees it (CPUs, sockets, cores, threads, memory), less the uptime
NODE=$(slurmd -C | head -1 | sed 's/ UpTime=.*//')
[[ $NODE == "NodeName=$HOST "* ]] || die "slurmd -C did not describe this host ($HOST): $NODE"

write_config() {  # write_config PATH MODE: stdin to PATH if it differs; 0 if it changed
  local new
  new=$(cat)
  if [ -f "$1" ] && [ "$(cat "$1")" = "$new" ]; then
    return 1
  fi
  printf '%s\n' "$new" > "$1"
  chmod "$2" "$1"
  return 0
}

changed=()
write_config "$ETC/slurm.conf" 644 << EOF && changed+=(slurmctld slurmd)
$MARK
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageEnforce=associations,limits,qos
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
OverTimeLimit=0
InactiveLimit=0
MinJobAge=300
DefMemPerCPU=1000
$NODE NodeAddr=127.0.0.1 Features=ci State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
write_config "$ETC/slurmdbd.conf" 600 << EOF && changed+=(slurmdbd)
$MARK
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
for daemon in "${changed[@]}"; do
  if [ -n "$(recorded "$daemon")" ]; then
    say "$daemon's configuration changed: restarting it"
    stop "$daemon"
  fi
done

# ---------------------------------------------------------------- munge
if [ -z "$(recorded munged)" ]; then
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
  chmod 0400 /etc/munge/munge.key
  start munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
fi
wait_for munged 30 bash -c 'munge -n | unmunge'

# ---------------------------------------------------------------- MariaDB, private to this cluster
if [ -z "$(recorded mariadbd)" ]; then
  if [ ! -d "$DIR/mysql/mysql" ]; then
    mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql" --auth-root-authentication-method=socket \
      > "$DIR/log/mariadb-install-db.out" 2>&1 || die "mariadb-install-db failed; see $DIR/log/mariadb-install-db.out"
  fi
  rm -f "$SOCKET"
  start mariadbd mariadbd --no-defaults --user=root --datadir="$DIR/mysql" --socket="$SOCKET" \
    --pid-file="$DIR/run/mysqld.pid" --bind-address=127.0.0.1 --port=$DB_PORT --log-error="$DIR/log/mariadb.err" \
    --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900
fi
wait_for MariaDB 60 mariadb-admin --no-defaults --socket="$SOCKET" -u root ping
mariadb --no-defaults --socket="$SOCKET" -u root -e "
  CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

# ---------------------------------------------------------------- slurmdbd, the cluster's account and users
[ -n "$(recorded slurmdbd)" ] || start slurmdbd slurmdbd -D
wait_for slurmdbd 60 sacctmgr -n list cluster
if [ -z "$(sacctmgr -n -P list cluster "$CLUSTER" format=cluster)" ]; then
  sacctmgr -i add cluster "$CLUSTER" > /dev/null
fi
if [ -z "$(sacctmgr -n -P list account ci format=account)" ]; then
  sacctmgr -i add account ci Cluster="$CLUSTER" Description="cleanmisl tests" Organization=cleanmisl > /dev/null
fi
# root, and the user who ran this through sudo (an operator: tests/test_slurm.py sets a submit limit on itself)
for user in root ${SUDO_USER:-}; do
  if [ -z "$(sacctmgr -n -P list association cluster="$CLUSTER" account=ci user="$user" format=user)" ]; then
    sacctmgr -i add user "$user" Account=ci Cluster="$CLUSTER" > /dev/null
  fi
  if [ "$user" != root ] && [ "$(sacctmgr -n -P list user "$user" format=adminlevel)" = None ]; then
    sacctmgr -i modify user where name="$user" set AdminLevel=Operator > /dev/null
  fi
done

# ---------------------------------------------------------------- slurmctld, slurmd
[ -n "$(recorded slurmctld)" ] || start slurmctld slurmctld -D -i
wait_for slurmctld 60 scontrol ping
[ -n "$(recorded slurmd)" ] || start slurmd slurmd -D
node_up() { [[ $(sinfo -h -N -n "$HOST" -o %T) =~ ^(idle|mixed|allocated) ]]; }
for _ in $(seq 150); do
  node_up && break
  if [[ $(sinfo -h -N -n "$HOST" -o %T) =~ ^(down|drain) ]]; then  # left down by an earlier stop
    scontrol update NodeName="$HOST" State=RESUME 2> /dev/null || true
  fi
  sleep 0.2
done
node_up || die "the node $HOST did not come up: $(sinfo -h -N -n "$HOST" -o '%T %E'); see $DIR/log/"
say "up: cluster $CLUSTER, partition ci, node $HOST ($(sinfo -h -N -n "$HOST" -o '%c CPUs, %m MB'))"
