"""The sbatch templates under a real Slurm: slurmctld and munged on this machine, a slurmd
per node in its own network, UTS and mount namespaces (tools/slurm/local_cluster.py).

Every job is submitted with ``sbatch`` as a user on a cluster without GPUs would submit it
(the templates' header: ``--gpus-per-node=0``, ``NPROC_PER_NODE``) and judged by its output
file and ``scontrol show job``: GPT and MoE (expert parallelism) on 2 nodes, one-job DiLoCo,
elastic sites (a lighthouse job and two replica jobs of different sizes, one cancelled and
resubmitted), a requeue at the time limit, scancel, and bad submissions. All of them run
side by side in one module-scoped :class:`Session` on one cluster of 3 nodes, which does
what the user would do mid-run (scancel, resubmit, ...) as each job reaches that point;
the tests read what it recorded. Without root or Slurm the tests skip (one line at the end
of the run says how to enable them; ``.ci/run`` installs Slurm).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY, read_metrics, train_losses

sys.path.insert(0, str(REPO / "tools" / "slurm"))
import local_slurm  # noqa: E402
from local_cluster import CLI_NAME  # noqa: E402
from local_slurm import LocalSlurm  # noqa: E402

UNAVAILABLE = local_slurm.unavailable()
needs_slurm = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"local Slurm cluster {UNAVAILABLE}")

H = 4  # DiLoCo inner steps
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED")
CPU = ["--gpus-per-node=0", "--cpus-per-task=1"]  # the templates' line for a cluster without GPUs
NOISE = re.compile(r"Warning|warnings\.warn|^\d+: [WEI]\d{4} \d\d:\d\d|\[c10d\]|keep-alive")
"""Lines that are not the training's own: Python warnings, torch's C++ and torchrun's log lines."""


class Job:
    """One sbatch submission: its id, output file (the template's slurm-%x-%j.out pattern, in
    the session's folder) and latest ``scontrol show job`` record (:meth:`Session.refresh`)."""

    NAMES = {"pretrain_gpt.sbatch": "loco-gpt", "pretrain_moe.sbatch": "loco-moe",
             "lighthouse.sbatch": "loco-lighthouse", "diloco_replica.sbatch": "loco-diloco-replica"}

    def __init__(self, session: "Session", script: str, args: list[str], env: dict):
        self.id = session.cluster.sbatch([f"--output={session.tmp}/slurm-%x-%j.out", *args, f"tools/slurm/{script}"],
                                         env=env)
        self.out = session.tmp / f"slurm-{self.NAMES[script]}-{self.id}.out"
        self.record: dict = {}

    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    @property
    def ended(self) -> bool:
        return self.record.get("JobState") in ENDED

    def why(self) -> str:
        """For an assertion message: the job's state and its output's tail."""
        return f"job {self.id} {self.record.get('JobState')} exit {self.record.get('ExitCode')}:\n{self.text()[-3000:]}"


def iterations(run_dir: pathlib.Path) -> list[int]:
    return [m["iteration"] for m in read_metrics(run_dir / "metrics.jsonl") if "train/lm_loss" in m]


class Session:
    """Every job of the module on one cluster, driven by :meth:`run` until all have ended."""

    def __init__(self, cluster: LocalSlurm, tmp: pathlib.Path, corpus: pathlib.Path):
        self.cluster, self.tmp, self.corpus = cluster, tmp, corpus
        self.jobs: dict[str, Job] = {}
        self.notes: dict = {}

    def cache(self, name: str) -> str:
        """A --data-cache-path of the job's own (megatron's index caches are written there
        without a lock shared between jobs) holding hard links to the built-in corpus."""
        folder = self.tmp / f"cache-{name}"
        if not folder.exists():
            shutil.copytree(self.corpus, folder / self.corpus.name, copy_function=os.link)
        return str(folder)

    def env(self, **values: str) -> dict:
        env = self.cluster.env()
        for key in ("DATA_PATH", "TOKENIZER", "DILOCO_REPLICAS", "SETUP", "RUN_DIR", "RUN_ROOT", "CONFIG",
                    "OVERRIDES_STR", "LIGHTHOUSE", "REPLICA_ID", "REPLICAS", "WANDB_API_KEY", "MAX_RESTARTS"):
            env.pop(key, None)
        # python on the nodes is this interpreter (the virtual environment's, when there is one)
        env.update(PATH=f"{pathlib.Path(sys.executable).parent}:{env['PATH']}", OMP_NUM_THREADS="1",
                   NPROC_PER_NODE="1", WANDB_MODE="offline", **values)
        return env

    def submit(self, name: str, script: str, args: list[str], **env: str) -> Job:
        self.jobs[name] = Job(self, script, args, self.env(**env))
        return self.jobs[name]

    def overrides(self, name: str, *more: str) -> str:
        return " ".join([*TINY, "--data-cache-path", self.cache(name), *more])

    # -- the scenarios: submit, then act when a job reaches a point -------------------------
    def start(self) -> None:
        tmp = self.tmp
        # The time limit: --time 3 minutes with USR1 120 s before it (Slurm sends it up to a
        # minute early: 0 to 60 s after the start, here often while the training starts; the
        # 2 minutes left hold the start-up, the save and the exit on a loaded machine). The
        # config trains "forever"; once the job has saved and requeued itself, the target
        # becomes the saved iteration + 3 and the limit 10 minutes, so the requeued start
        # ends at --train-iters (instead of being signalled again).
        config = tmp / "tiny_requeue.yaml"  # (a tiny_* config needs no DATA_PATH)
        config.write_text(self._requeue_config(100000))
        self.submit("requeue", "pretrain_gpt.sbatch", [*CPU, "--time=3", "--signal=B:USR1@120"],
                    CONFIG=str(config), RUN_DIR=str(tmp / "requeue"), OVERRIDES_STR=self.overrides("requeue"))
        # Elastic sites: a lighthouse, replica 0 on 2 nodes, replica 1 on 1 node.
        root = tmp / "sites"
        # heartbeat 10 s: a live replica starved of CPU on this loaded machine is not taken for dead
        self.submit("lighthouse", "lighthouse.sbatch", ["--cpus-per-task=1", "--time=20"], RUN_ROOT=str(root),
                    LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS="10000", LIGHTHOUSE_JOIN_TIMEOUT_MS="20000")
        self.site_env = dict(RUN_ROOT=str(root), REPLICAS="2", CONFIG="configs/tiny_gpt.yaml")
        self.submit("site0", "diloco_replica.sbatch", [*CPU, "--nodes=2", "--time=20"], REPLICA_ID="0",
                    OVERRIDES_STR=self._site(0), **self.site_env)
        self.submit("site1", "diloco_replica.sbatch", [*CPU, "--nodes=1", "--time=20"], REPLICA_ID="1",
                    OVERRIDES_STR=self._site(1), **self.site_env)
        self.submit("gpt", "pretrain_gpt.sbatch", [*CPU, "--time=10"], CONFIG="configs/tiny_gpt.yaml",
                    RUN_DIR=str(tmp / "gpt"), OVERRIDES_STR=self.overrides("gpt", "--train-iters", "8"),
                    SETUP=f'echo "$(hostname)" >> {tmp / "setup.log"}')
        # MoE with expert parallelism across the 2 nodes; scancel'ed once it has trained a few steps.
        self.submit("moe", "pretrain_moe.sbatch", [*CPU, "--nodes=2", "--time=10"], CONFIG="configs/tiny_moe.yaml",
                    RUN_DIR=str(tmp / "moe"), OVERRIDES_STR=self.overrides(
                        "moe", "--train-iters", "10000", "--expert-model-parallel-size", "2"))
        self.submit("diloco", "pretrain_gpt.sbatch", [*CPU, "--time=10"], CONFIG="configs/tiny_gpt.yaml",
                    RUN_DIR=str(tmp / "diloco"), DILOCO_REPLICAS="2",
                    OVERRIDES_STR=self.overrides("diloco", "--train-iters", "8", "--diloco-inner-steps", str(H)))
        for name, script, args, env, _ in BAD:
            self.submit(name, script, [*CPU, *args], RUN_DIR=str(tmp / name), RUN_ROOT=str(tmp / name), **env)

    def _site(self, replica: int) -> str:
        """A replica job's OVERRIDES_STR: it trains until stopped; one lane (the 1-node
        replica's world size); outer steps every H steps, each saved."""
        return self.overrides(f"sites{replica}", "--train-iters", "10000", "--lr-decay-iters", "100",
                              "--diloco-inner-steps", str(H), "--diloco-outer-ranks", "1", "--save-interval", str(H),
                              "--diloco-quorum-timeout-s", "300", "--diloco-exchange-timeout-s", "60")

    def _requeue_config(self, train_iters: int) -> str:
        text = (REPO / "configs" / "tiny_gpt.yaml").read_text()
        return re.sub(r"(?m)^train-iters: .*$", f"train-iters: {train_iters}\nlr-decay-iters: 100", text)

    def refresh(self) -> None:
        """Every job's record, from one ``scontrol show job``."""
        records = self.cluster.jobs()
        for job in self.jobs.values():
            job.record = records.get(job.id, job.record)

    def step(self) -> None:
        """Act on whatever has become due (called every second)."""
        j, n, tmp = self.jobs, self.notes, self.tmp
        if "requeued_at" not in n and j["requeue"].record.get("Restarts", "0") != "0":
            saved = int((tmp / "requeue" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
            n["requeued_at"] = saved
            (tmp / "tiny_requeue.yaml").write_text(self._requeue_config(saved + 3))
            self.cluster.scontrol("update", f"JobId={j['requeue'].id}", "TimeLimit=10")
        if "moe_cancelled_after" not in n and len(iterations(tmp / "moe")) >= 3:
            n["moe_cancelled_after"] = max(iterations(tmp / "moe"))
            self.cluster.scancel(j["moe"].id)
        if n.get("sites") != "over":
            self._sites()

    def _sites(self) -> None:
        """Cancel replica 1 after two outer steps, resubmit it once replica 0 has seen it
        leave, stop both with their stop files once it has healed and trained an outer step
        more, then cancel the lighthouse. A site ending otherwise ends the scenario early."""
        j, n, root = self.jobs, self.notes, self.tmp / "sites"
        phase = n.setdefault("sites", "training")
        live = {"training": ("site0", "site1"), "cancelled": ("site0",), "rejoining": ("site0", "site1b")}
        if any(j[name].ended for name in live.get(phase, ())):
            phase = "over"
        elif phase == "training":
            if min(max(iterations(root / f"replica{r}"), default=0) for r in (0, 1)) >= 2 * H + 1:
                n["site1_cancelled_after"] = max(iterations(root / "replica1"))
                self.cluster.scancel(j["site1"].id)
                phase = "cancelled"
        elif phase == "cancelled":
            # resubmitted once the live replica has seen it leave (before, the lighthouse still
            # counts the old job alive and refuses a second job with its id)
            if j["site1"].ended and "DiLoCo: replica 1 left" in j["site0"].text():
                n["site1_rows_before"] = len(read_metrics(root / "replica1" / "metrics.jsonl"))
                self.submit("site1b", "diloco_replica.sbatch", [*CPU, "--nodes=1", "--time=20"], REPLICA_ID="1",
                            OVERRIDES_STR=self._site(1), **self.site_env)
                phase = "rejoining"
        elif phase == "rejoining":
            healed = re.search(r"healed from replica 0 .*?iteration (\d+)", j["site1b"].text())
            rows = read_metrics(root / "replica1" / "metrics.jsonl")[n["site1_rows_before"]:]
            after = [m["iteration"] for m in rows if "train/lm_loss" in m]
            if healed and after and max(after) >= int(healed.group(1)) + H:
                n["healed_at"], n["stopped_after"] = int(healed.group(1)), max(after)
                for r in (0, 1):  # the run ends: both replicas stop at their next outer step
                    (root / f"replica{r}" / "STOP").touch()
                phase = "stopping"
        elif phase == "stopping" and j["site0"].ended and j["site1b"].ended:
            phase = "over"
        if phase == "over":
            for name in ("site0", "site1", "site1b", "lighthouse"):
                if name in j and not j[name].ended:
                    self.cluster.scancel(j[name].id)
        n["sites"] = phase

    def run(self, timeout: float) -> None:
        start = time.monotonic()
        self.start()
        while time.monotonic() < start + timeout:
            self.refresh()
            self.step()
            if all(job.ended for job in self.jobs.values()):
                break
            time.sleep(1)
        self.notes["wall_s"] = round(time.monotonic() - start)


BAD = [  # (job, template, sbatch args, environment, the one line of its output file)
    ("no-config", "pretrain_gpt.sbatch", [], {"CONFIG": "configs/no_such.yaml"},
     "error: CONFIG=configs/no_such.yaml does not exist"),
    ("data-no-tokenizer", "pretrain_gpt.sbatch", [], {"CONFIG": "configs/tiny_gpt.yaml", "DATA_PATH": "data/corpus"},
     "error: set both DATA_PATH and TOKENIZER (the dataset and the tokenizer it was made with)"),
    ("large-no-data", "pretrain_gpt.sbatch", [], {"CONFIG": "configs/gpt_1.3b.yaml"},
     "error: configs/gpt_1.3b.yaml needs real data: set DATA_PATH (indexed dataset prefix) and TOKENIZER "
     "(its tokenizer model)"),
    ("replicas-3-of-2", "pretrain_gpt.sbatch", [], {"CONFIG": "configs/tiny_gpt.yaml", "DILOCO_REPLICAS": "3"},
     "error: DILOCO_REPLICAS=3 does not divide the job's 2 nodes (replicas are whole nodes)"),
    ("bad-setup", "pretrain_moe.sbatch", ["--nodes=2"],
     {"CONFIG": "configs/tiny_moe.yaml", "SETUP": "source /nonexistent/venv/bin/activate"},
     "error: SETUP failed on {BatchHost}: bash: line 1: /nonexistent/venv/bin/activate: No such file or directory"),
    ("replica-id-2-of-2", "diloco_replica.sbatch", [], {"REPLICAS": "2", "REPLICA_ID": "2"},
     "error: set REPLICA_ID to this replica's id, 0 to 1"),
    ("replica-and-diloco-replicas", "diloco_replica.sbatch", [],
     {"REPLICAS": "2", "REPLICA_ID": "0", "DILOCO_REPLICAS": "2"},
     "error: DILOCO_REPLICAS splits one job into replicas; here each replica is a job (set REPLICAS)"),
]


def _host_network() -> tuple[str, str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    routes = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    return re.sub(r"\d+: ", "", links), routes


@pytest.fixture(scope="module")
def session(tmp_path_factory, cache_dir, cpu_kernels_built):
    """All the module's jobs, run to their ends on one 3-node cluster (bounded: 15 minutes,
    and each job's --time). The C++ kernels are built first, here: a job would start their
    first build in the background, which the cluster's end would kill."""
    from loco_megatron.data.corpus import default_corpus_dir, ensure_default_corpus

    tmp = tmp_path_factory.mktemp("slurm")
    ensure_default_corpus(cache_dir, 4096)  # once, before the jobs that share it start
    before = _host_network(), pathlib.Path("/etc/hosts").read_text()
    with LocalSlurm(nodes=3) as cluster:
        s = Session(cluster, tmp, default_corpus_dir(cache_dir, 4096))
        s.before = before
        s.run(timeout=900)
        yield s


@needs_slurm
def test_gpt_on_two_nodes_trains_and_prints_only_its_own_lines(session):
    """Guards against the GPT template failing under a real sbatch/srun: #SBATCH lines,
    srun's step environment and --label, c10d rendezvous across nodes with distinct
    hostnames, SETUP on every node (tried first on the first), and console noise (megatron's
    all-gather warning, torch's rms_norm dtype warning, c10d's and torchrun's log lines) in
    what the user reads."""
    job = session.jobs["gpt"]
    assert job.record["JobState"] == "COMPLETED" and job.record["ExitCode"] == "0:0", job.why()
    assert job.record["NumNodes"] == "2", job.record
    text = job.text()
    assert f"job {job.id} on {job.record['NodeList']} (2 nodes): configs/tiny_gpt.yaml" in text
    assert "0: layout: world 2 = TP 1 x PP 1 x DP 2" in text and "0: run summary: 8 iterations this run" in text
    losses = train_losses(read_metrics(session.tmp / "gpt" / "metrics.jsonl"))
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1], losses
    assert [line for line in text.splitlines() if NOISE.search(line)] == []
    nodes = session.cluster.hostnames(job.record["NodeList"])
    setup = (session.tmp / "setup.log").read_text().split()
    assert sorted(setup) == sorted([job.record["BatchHost"], *nodes]), setup  # the batch shell's try, then each node


@needs_slurm
def test_moe_with_expert_parallelism_and_scancel_saves_within_killwait(session):
    """Guards against the MoE template failing across nodes with expert parallelism, and
    against losing work on scancel: Slurm's SIGTERM reaches the batch shell, srun, torchrun,
    the ranks and wandb's service process (which ends: one line, the run goes on); the
    ranks agree on a step, save it and print their summary before KillWait's SIGKILL, and
    each node's torchrun says in one line that it was stopped (no traceback)."""
    job, run = session.jobs["moe"], session.tmp / "moe"
    assert job.record["JobState"] == "CANCELLED", job.why()
    text = job.text()
    assert "EP 2" in re.search(r"0: layout: .*", text).group(0), text[-3000:]
    # (SIGTERM reaches the ranks and the batch shell, whose trap writes the stop file:
    # whichever the training sees first names the stop)
    stop = re.search(r"0: stop requested \((?:SIGTERM received|stop file [^)]*)\): saving at iteration (\d+)", text)
    assert stop, job.why()
    saved = int(stop.group(1))
    assert saved >= session.notes["moe_cancelled_after"] >= 3
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(saved)
    assert f"0:   last checkpoint: {run}/checkpoints/iter_{saved:07d}" in text
    assert "0: warning: wandb's service process is gone (" in text
    for node in (0, 1):  # (on a machine so loaded that an agent outlives KillWait, Slurm kills it)
        assert (f"{node}: torchrun: stopped by SIGTERM, forwarded to the workers, which have exited" in text
                or re.search(rf"srun: error: n\d: task {node}: Killed", text)), text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@needs_slurm
def test_one_job_diloco_two_replicas_of_one_node(session):
    """Guards against DILOCO_REPLICAS not reaching the nodes or replicas splitting nodes
    under a real allocation: two replicas of one node each, meeting every H steps."""
    job = session.jobs["diloco"]
    assert job.record["JobState"] == "COMPLETED" and job.record["ExitCode"] == "0:0", job.why()
    text = job.text()
    assert "0: DiLoCo: 2 replicas of 1 ranks (TP 1 x PP 1 x DP 1; replica 0 = ranks 0-0)" in text, text[-3000:]
    assert re.search(rf"0: iter {H}/8 .*\| outer step ", text) and "0: DiLoCo: final outer step at iteration 8" in text


@needs_slurm
def test_elastic_sites_survive_a_cancelled_site_which_heals_when_resubmitted(session):
    """Guards against the elastic templates failing as separate Slurm jobs: the lighthouse
    job's address reaching replica jobs on other nodes, replicas of different sizes (2
    nodes and 1) training together, the other site training on when one is scancel'ed, and
    the site resubmitted with the same REPLICA_ID resuming its own checkpoint and healing
    from the live one; the lighthouse job outlives them until cancelled."""
    j, n, root = session.jobs, session.notes, session.tmp / "sites"
    assert "site1b" in j, f"replica 1 was not resubmitted: {n}\n{j['site0'].why()}\n{j['site1'].why()}"
    assert (j["site0"].record["NumNodes"], j["site1"].record["NumNodes"]) == ("2", "1")
    url = (root / "lighthouse.url").read_text().strip()
    assert re.fullmatch(r"http://n\d:29510", url) and f"lighthouse {url}" in j["lighthouse"].text()
    assert j["site1"].record["JobState"] == "CANCELLED", j["site1"].why()
    saved = re.search(r"0: stop requested \(SIGTERM received\): saving at iteration (\d+)", j["site1"].text())
    assert saved, j["site1"].why()
    # the live site saw it leave, trained on, and saw it join again
    site0 = j["site0"].text()
    left = site0.find("0: DiLoCo: replica 1 left (1 live: 0)")
    assert 0 < left < site0.rfind("0: DiLoCo: replica 1 joined"), site0[-3000:]
    # the resubmitted site resumed its own checkpoint and healed from replica 0, which had gone on
    rejoined = j["site1b"].text()
    resumed = int(saved.group(1))
    assert re.search(rf"0: resuming from {root}/replica1/checkpoints/iter_{resumed:07d} .* at iteration {resumed}\n",
                     rejoined), j["site1b"].why()
    assert n.get("healed_at", 0) >= n["site1_cancelled_after"] + H, j["site1b"].why()
    for name in ("site0", "site1b"):  # both ended at the stop files, after the heal
        assert j[name].record["JobState"] == "COMPLETED" and j[name].record["ExitCode"] == "0:0", j[name].why()
        assert "0: stop requested (stop file " in j[name].text(), j[name].why()
    assert j["lighthouse"].record["JobState"] == "CANCELLED", j["lighthouse"].why()


@needs_slurm
def test_time_limit_checkpoints_requeues_and_resumes_in_the_same_wandb_run(session):
    """Guards against losing work at a time limit under a real Slurm: --signal=B:USR1@N
    must reach the batch shell, training save and stop, `scontrol requeue` requeue the job
    (Slurm holds it for its credential lifetime), and the requeued start, appending to the
    same output file, resume from that checkpoint, log to the same offline wandb run and
    end at --train-iters."""
    job, run = session.jobs["requeue"], session.tmp / "requeue"
    saved = session.notes.get("requeued_at")
    assert saved is not None, job.why()
    assert job.record["JobState"] == "COMPLETED" and job.record["Restarts"] == "1", job.why()
    text = job.text()
    assert text.count(f"job {job.id} on ") == 2, text[-3000:]  # two starts in one output file
    first, second = text.split(f"job {job.id} on ")[1:]
    assert "signal received: asking training to checkpoint and stop" in first
    # (B:USR1 reaches the batch shell only, which asks the training through the stop file)
    assert f"0: stop requested (stop file {run}/STOP): saving at iteration {saved}" in first
    assert f"checkpoint written; requeueing job {job.id}" in first
    assert re.search(rf"0: resuming from {run}/checkpoints/iter_{saved:07d} .* at iteration {saved}\n", second)
    assert iterations(run)[-3:] == [saved + 1, saved + 2, saved + 3]
    assert f"0: run summary: 3 iterations this run, now at iteration {saved + 3}" in second
    run_id = (run / "checkpoints" / "wandb_run_id").read_text().strip()
    wandb_runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(d.name.endswith(f"-{run_id}") for d in wandb_runs), wandb_runs


@needs_slurm
@pytest.mark.parametrize("name,line", [(b[0], b[4]) for b in BAD], ids=[b[0] for b in BAD])
def test_bad_submission_fails_with_one_line_and_exit_code_2(session, name, line):
    """Guards against a bad submission that waits in the queue and then fails obscurely (or
    trains the wrong thing): the job's output file is one line naming the problem, and
    Slurm records it FAILED with exit code 2."""
    job = session.jobs[name]
    assert job.record["JobState"] == "FAILED" and job.record["ExitCode"] == "2:0", job.why()
    assert job.text().splitlines() == [line.format(**job.record)]


@needs_slurm
def test_the_cluster_stops_and_leaves_nothing_behind(session):
    """Guards against a local cluster that outlives its user: after stopping, no daemon,
    no process of a job, namespace, veth, route, /etc/hosts line or state folder is left.
    (Runs last: it stops the module's cluster.)"""
    cluster = session.cluster
    folder = str(cluster.dir)
    cluster.close()
    assert cluster.leftovers() == []
    assert (_host_network(), pathlib.Path("/etc/hosts").read_text()) == session.before
    mine = [p for p in pathlib.Path("/proc").glob("[0-9]*") if folder in _cmdline(p)]
    assert mine == []


def _cmdline(proc: pathlib.Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_refuses_in_one_line_without_slurm_or_root(tmp_path):
    """Guards against a local cluster that half-starts where it cannot run: not as root, or
    without the Slurm programs, it names the reason (and the apt-get line) in one line;
    ``start`` prints it, exits 2 and creates nothing."""
    assert local_slurm.unavailable(euid=1000) == "needs root (network namespaces and the Slurm daemons)"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "slurm" / "local_cluster.py"), "start"],
                          env=dict(os.environ, PATH=str(tmp_path)), capture_output=True, text=True, timeout=60)
    reason = ("needs Slurm and munge (sbatch, scontrol, sinfo not found): apt-get install -y slurm-wlm munge"
              if os.geteuid() == 0 else local_slurm.unavailable())
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.splitlines() == [
        f"error: local Slurm cluster {reason}"], proc.stderr
    assert not (local_slurm.STATE_ROOT / CLI_NAME).exists()
