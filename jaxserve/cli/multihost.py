"""One model over several processes (hosts): ``jax.distributed`` wiring for ``jaxserve serve``.

``jaxserve serve ... --tensor-parallel-size N --num-processes P --process-id I
--coordinator-address HOST:PORT`` on every process (the same flags except ``--process-id``):
the tensor-parallel mesh spans the devices of all processes (``jax.devices()`` is global after
``jax.distributed.initialize``). JAX runs one program per process (multi-controller SPMD), so
process 0 runs the scheduler and the HTTP server and, before each step, broadcasts the step's
bucket and packed inputs; every other process loops in ``ModelRunner.follow`` running the same
compiled program on its shards until process 0 shuts down. On CPUs the cross-process
collectives go through gloo; on GPUs through NCCL.
"""

from __future__ import annotations

import jax


def initialize(coordinator_address: str | None, num_processes: int, process_id: int) -> bool:
    """Join the process group; a no-op (returns False) when ``num_processes == 1``.

    Must run before anything touches a JAX device. Raises ValueError naming the flag for an
    inconsistent setting (no coordinator, a process id out of range).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if num_processes == 1:
        return False
    if not coordinator_address:
        raise ValueError("--coordinator-address HOST:PORT is required with --num-processes > 1")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; GPUs use NCCL
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return True
