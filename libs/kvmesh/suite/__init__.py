"""The local suite an operator drives: `cli` (the `kvmesh` command), `local` (the processes `kvmesh up` lays
out), `config` (its settings file), `launcher` (start, wait for, stop a service process), `admin` (the admin
commands), `observe` (a local Prometheus), `shm_leftovers` (shared memory a killed run left behind)."""
