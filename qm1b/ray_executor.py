"""The Ray executor: a run's molecules as many small Ray tasks that free workers pull, each labelling
its molecules into a shard of its own (``--executor ray``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from pyscf_ipu.resolution import resolve
from pyscf_ipu.runtime import reuse_freed_memory

from .batching import batch_sizes, check_memory, chosen
from .cores import claim_cores, task_environment
from .inputs import Input
from .settings import GenerateConfig, Run
from .store import shard_count
from .summary import Summary

# labels inputs into a shard: (run, inputs, (i, n), resume) -> its summary
Labelling = Callable[[Run, list, tuple, bool], Summary]


class ClusterLostError(RuntimeError):
    """The Ray cluster lost a process that the run needs (a raylet, a node, a worker past its retries)."""


def _what_died(err: Exception) -> str:
    """One line naming what a Ray error says died, with Ray's own first line."""
    import ray.exceptions as errors

    kinds = [(errors.LocalRayletDiedError, "this node's raylet (Ray's process that runs the tasks here)"),
             (errors.NodeDiedError, "a node"), (errors.WorkerCrashedError, "a task's worker, past its retries"),
             (errors.ObjectLostError, "a task's result")]  # fmt: skip
    what = next((text for kind, text in kinds if isinstance(err, kind)), "a process it needs")
    detail = (str(err).strip().splitlines() or [""])[0]
    return f"the Ray cluster lost {what} ({type(err).__name__}: {detail})"


def ray_tasks(gen: GenerateConfig, molecules: int) -> int:
    """How many tasks a Ray run splits its molecules into: as many as ``gen.out`` already holds shards
    of (a resumed run keeps its split, so no molecule changes task), else one per ``task_molecules``."""
    if gen.resume and (existing := shard_count(gen.out)):
        return existing
    return max(1, -(-molecules // gen.task_molecules))


def _ray_task(label: Labelling, run: Run, inputs: list[Input], shard: tuple[int, int]) -> Summary:
    """One Ray task: claim ``--task-threads`` cores of the node for this worker and set up its memory
    reuse (both before JAX starts), then ``label`` ``inputs`` into their shard, continuing what an
    earlier attempt committed."""
    claim_cores(run.gen.task_threads)
    reuse_freed_memory()
    return label(run, inputs, shard, True)


def run_ray(run: Run, label: Labelling) -> Summary:
    """The molecules as many small Ray tasks, which free workers pull: task k labels the molecules with
    ``molecule_id % n == k`` into shard k of n, by ``label`` (the local executor's
    :func:`~qm1b.generate.label_molecules`, handed in so that this module never imports the
    dispatcher). A task whose worker died is run again by Ray and continues its shard from what it
    had committed. One progress bar and one summary for the run."""
    import ray
    from tqdm import tqdm

    start = time.perf_counter()
    gen, inputs = run.gen, run.inputs()
    if not gen.resume and shard_count(gen.out):
        raise FileExistsError(f"{gen.out} already holds a dataset: pass --resume to continue it, or choose another --out")
    method = resolve(run.dft, run.budget_gb)
    buckets = run.buckets(method, inputs)
    sizes = batch_sizes(run, method, inputs, buckets)
    check_memory(run, method, sizes)  # each task's batches
    picked = chosen(run.dft, sizes)
    n = ray_tasks(gen, len(inputs))
    chunks = [[m for m in inputs if m.molecule_id % n == k] for k in range(n)]
    ray.init(address=gen.ray_address, ignore_reinit_error=True, log_to_driver=False)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    task = ray.remote(_ray_task).options(num_cpus=gen.task_threads, num_gpus=gpus, max_retries=3,
                                         runtime_env={"env_vars": task_environment(gen.task_threads)})
    quiet = dataclasses.replace(run, gen=dataclasses.replace(gen, progress=False))
    # the output was checked above, so every task resumes its shard: a retried task continues it
    pending = {task.remote(label, quiet, chunk, (k, n)):
               sum(map(run.source.expected, chunk)) for k, chunk in enumerate(chunks) if chunk}  # fmt: skip
    total = Summary(out=gen.out, shard=gen.shard, method=picked)
    with tqdm(total=sum(pending.values()), unit="conf", disable=not gen.progress, smoothing=0.1,
              desc=picked) as bar:
        while pending:
            try:
                (ready,), _ = ray.wait(list(pending), num_returns=1)
                total.add(ray.get(ready))
            except ray.exceptions.RayTaskError as err:  # the task's own error (a full disk, ...), not Ray's wrapping
                raise err.cause from None
            except ray.exceptions.RayError as err:  # Ray itself lost a process the run needs
                raise ClusterLostError(_what_died(err)) from None
            total.tasks += 1
            bar.update(pending.pop(ready))
    total.seconds = time.perf_counter() - start
    return total
