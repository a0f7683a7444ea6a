"""Choosing among settings (hf_zero.plan.planner.choose): what may be skipped without simulation, against the
simulated settings themselves."""
import copy
import time

import pytest

from hf_zero.plan.machine import Machine
from hf_zero.plan.planner import choose, distinct_ranks, plan, probe_rank
from hf_zero.plan.simulate import Job, RankStep, Setting

MICRO = 16


@pytest.fixture
def each_simulation_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test's choices over one job on several machines simulate each (job, setting, rank) once, which halves these
    tests' time: a simulation depends on nothing else (the machine only judges it), and the FLOPs a later call is
    given, counted for another setting of the same model, micro-batch and checkpointing, are the same (they do not
    depend on the stage, offload, hpZ or rank). One simulation at a time: side by side is
    test_a_slow_choice_simulates_side_by_side_and_chooses_what_one_simulation_at_a_time_does's."""
    from hf_zero.plan import planner

    simulated: dict[tuple[Job, Setting, int], RankStep] = {}
    simulate_really = planner.simulate_rank

    def once(job: Job, setting: Setting, rank: int, flops: int | None = None) -> RankStep:
        if (job, setting, rank) not in simulated:
            simulated[job, setting, rank] = simulate_really(job, setting, rank, flops)
        step = simulated[job, setting, rank]
        assert flops is None or flops == step.flops, (setting, flops, step.flops)
        return copy.deepcopy(step)

    monkeypatch.setattr(planner, "_cores", lambda: 1)  # a slow machine would otherwise spawn, which `once` cannot
    monkeypatch.setattr(planner, "simulate_rank", once)


def test_an_offloaded_checkpointed_setting_is_simulated_where_only_activations_ruled_out_its_uncheckpointed_twin():
    """Offload moves model states, checkpointing activations: a device too small for stage 3's model states plus its
    checkpointed activations, and for the activations without checkpointing, fits stage 3 offloaded with
    checkpointing. Its uncheckpointed twin, skipped because its activations alone overflow, says nothing of it."""
    job = Job("gpt2-tiny", 1, 2, seq_len=128)
    at = [probe_rank(job)]
    big = Machine(10**12)
    kept = plan(job, Setting(3, micro_batch=MICRO, gradient_checkpointing=True), big, at).busiest
    offloaded = plan(job, Setting(3, "cpu", "cpu", MICRO, True), big, at).busiest
    unchecked = plan(job, Setting(3, micro_batch=MICRO), big, at).busiest
    device = (offloaded.device_peak + kept.device_peak) // 2
    assert offloaded.device_peak <= device < kept.device_peak and unchecked.transient > device  # the premise
    chosen, candidates = choose(Job(job.model, 1, 2, seq_len=128, gpu_memory=device), Machine(device),
                                {"zero_stage": 3, "micro_batch": MICRO})
    outcomes = {str(c.setting): c.outcome for c in candidates}
    assert chosen is not None and chosen.fits, outcomes
    assert chosen.setting.offload_optimizer == "cpu" and chosen.setting.gradient_checkpointing
    assert outcomes["stage 3, optimizer on cpu, micro-batch 16"].startswith(
        "not simulated: its activations and temporaries alone")


@pytest.mark.usefixtures("each_simulation_once")
def test_offload_is_weighed_where_the_memory_it_frees_makes_room_for_a_larger_micro_batch():
    """A device on which stage 3 fits micro-batch 1 but not 2 on each of 2 ranks, its activations the limit:
    offloading the optimizer frees its states and gradients, room for a larger micro-batch. That offloaded setting is
    simulated, not skipped for fitting with less offload, and its larger micro-batch, over which a slow link's
    per-step traffic is spread, wins where the host's step and copies are cheap and loses where they are dear. At the
    largest micro-batch allowed there is nothing to gain, and it is skipped."""
    job = Job("gpt2-tiny", 1, 2, seq_len=64)
    kept = plan(job, Setting(3), Machine(10**12)).busiest
    device = kept.device_peak + kept.transient // 4
    # The premise: the peak is the backward's, and the optimizer's states and gradients there would make room for a
    # second sample's activations.
    assert kept.device["activations"] > 0
    assert kept.device["optimizer_states"] + kept.device["gradients"] > 0.75 * kept.transient
    fixed = {"zero_stage": 3, "gradient_checkpointing": False, "offload_param": "none"}

    def choice(machine: Machine, max_micro_batch: int = 8) -> tuple:
        chosen, candidates = choose(job, machine, fixed, max_micro_batch=max_micro_batch)
        return chosen.setting, {c.setting.offload_optimizer: c for c in candidates}

    slow_link = {"intra_node_gbps": 1e-3, "pcie_gbps": 1e6}
    cheap_host = Machine(device, cpu_adam_ns=1e-3, **slow_link)
    chosen, candidates = choice(cheap_host)
    assert candidates["none"].setting.micro_batch == 1 and candidates["cpu"].plan is not None
    assert (chosen.offload_optimizer, chosen.micro_batch) == ("cpu", candidates["cpu"].setting.micro_batch)
    assert chosen.micro_batch > 1
    # Where the host's step alone outweighs the larger micro-batch, it is not even simulated.
    chosen, candidates = choice(Machine(device, cpu_adam_ns=1e9, **slow_link))
    assert (chosen.offload_optimizer, chosen.micro_batch) == ("none", 1)
    assert candidates["cpu"].plan is None and candidates["cpu"].outcome.startswith(
        "not simulated: fits with less offload; at micro-batch 2 at most, with the host's step, it would run at most ")
    # Where it does not, simulated, it may still lose on what the bound left out (its copies).
    chosen, candidates = choice(Machine(device, cpu_adam_ns=1e-3, intra_node_gbps=1e-3, pcie_gbps=1e-9))
    assert (chosen.offload_optimizer, chosen.micro_batch) == ("none", 1)
    assert candidates["cpu"].plan is not None and candidates["cpu"].outcome.startswith("slower: ")
    chosen, candidates = choice(cheap_host, max_micro_batch=1)
    assert (chosen.offload_optimizer, chosen.micro_batch) == ("none", 1)
    assert candidates["cpu"].outcome == ("not simulated: fits with less offload, at the largest micro-batch allowed "
                                         "(1); offloading more adds host time and copies")


def test_a_slow_choice_simulates_side_by_side_and_chooses_what_one_simulation_at_a_time_does(monkeypatch):
    """Where a simulation of the job was slow (planner.PARALLEL_AFTER_S), the next candidate the rules would simulate
    runs beside the current one, beside the last one the first ranks of the check the fastest so far would get, and
    the winner's check simulates its other distinct ranks at once, in spawned interpreters beside this one
    (planner._simulated_at_once), each (setting, rank) once. Every candidate's outcome, and each rank of the chosen
    plan, is what the same choice made one simulation at a time finds: where the candidate simulated beside turns
    out ruled out by the current one's result (hpZ, where plain stage 3 does not fit), its result is dropped."""
    from dataclasses import asdict

    import psutil

    from hf_zero.plan import planner
    from hf_zero.plan.simulate import simulate_rank

    job = Job("gpt2-tiny", 2, 2, seq_len=32)
    fixed = {"zero_stage": 3, "offload_optimizer": "none", "offload_param": "none"}

    def choice(machine: Machine) -> tuple[list[dict], dict[str, str], list[str]]:
        said = []
        chosen, candidates = choose(job, machine, fixed, max_micro_batch=2, say=said.append)
        ranks = [{**asdict(rank), "seconds": 0} for rank in chosen.ranks] if chosen else []
        return ranks, {str(c.setting): c.outcome for c in candidates}, said

    big = Machine(10**12)
    one_at_a_time, outcomes, said = choice(big)
    assert said[:2] == ["simulating stage 3, micro-batch 1", "simulating stage 3, micro-batch 1, checkpointing"]
    winner = said[-1].removeprefix("checking ").removesuffix(" at ranks [0, 1, 3]")
    assert winner.endswith("micro-batch 2") and said[-2] == f"checking {winner} at rank 1"
    plain_checkpointed = plan(job, Setting(3, gradient_checkpointing=True), big, [probe_rank(job)]).busiest
    small = Machine(plain_checkpointed.device_peak - 1)  # plain stage 3 fits with neither, so hpZ is not simulated
    small_outcomes = choice(small)[1]

    at_once = []
    simulated_at_once = planner._simulated_at_once
    monkeypatch.setattr(planner, "_simulated_at_once", lambda job, runs, *more: at_once.append(
        [(str(setting), rank) for setting, rank in runs]) or simulated_at_once(job, runs, *more))
    monkeypatch.setattr(planner, "PARALLEL_AFTER_S", 0.0)
    monkeypatch.setattr(planner, "_cores", lambda: 3)
    monkeypatch.setattr(planner, "_counted_flops", {})  # counted again, in the runs side by side
    beside, beside_outcomes, said = choice(big)
    assert beside == one_at_a_time and beside_outcomes == outcomes
    assert said[1] == "simulating stage 3, micro-batch 1, checkpointing, and stage 3, hpZ 2, micro-batch 1 beside it"
    # one for each worker: two, on three cores
    assert said[2] == (f"simulating stage 3, hpZ 2, micro-batch 1, checkpointing, and checking {winner} at ranks "
                       "[1, 0] beside it")
    assert said[-1] == f"checking {winner} at ranks [1, 0, 3]" and at_once[-1] == [(winner, 3)]
    # the results simulated beside are the ones used: each (setting, rank) is simulated once
    simulated = [run for runs in at_once for run in runs]
    assert len(simulated) == len(set(simulated)) == 7
    assert beside[-1]["sent"]["inter-node"] > 0  # rank 3's ring crosses to node 0
    # The interpreters started for it go once the choice is made: a run planned by --zero_stage auto trains without.
    assert planner._workers.pool is None
    assert not psutil.wait_procs(_spawned_interpreters(), timeout=30)[1]

    # Whether a result simulated beside is dropped does not depend on where it ran: here, one after the other.
    monkeypatch.setattr(planner, "_simulated_at_once",
                        lambda job, runs, *more: [simulate_rank(job, *run) for run in runs])
    ranks, beside_outcomes, said = choice(small)
    assert ranks == [] and beside_outcomes == small_outcomes
    assert "simulating stage 3, micro-batch 1, checkpointing, and stage 3, hpZ 2, micro-batch 1, checkpointing " \
           "beside it" in said
    assert small_outcomes["stage 3, hpZ 2, micro-batch 1, checkpointing"].startswith("not simulated: without hpZ")


@pytest.mark.usefixtures("each_simulation_once")
def test_a_check_simulated_beside_the_last_candidate_is_dropped_where_that_candidate_wins(monkeypatch):
    """Beside the last candidate simulated runs the first rank of the check the fastest candidate so far would get
    (planner._checks_to_come); where the last turns out faster, that work is lost and the choice is what one
    simulation at a time finds, even where that simulation failed (a worker killed for memory): its error is raised
    only where its result is used. Here offloading the optimizer makes room for a larger micro-batch, which wins (as
    in test_offload_is_weighed_where_the_memory_it_frees_makes_room_for_a_larger_micro_batch)."""
    from hf_zero.plan import planner

    job = Job("gpt2-tiny", 1, 2, seq_len=64)
    kept = plan(job, Setting(3), Machine(10**12)).busiest
    machine = Machine(kept.device_peak + kept.transient // 4, cpu_adam_ns=1e-3, intra_node_gbps=1e-3, pcie_gbps=1e6)
    fixed = {"zero_stage": 3, "gradient_checkpointing": False, "offload_param": "none"}

    def choice() -> tuple[Setting, dict[str, str], list[dict], list[str]]:
        said = []
        chosen, candidates = choose(job, machine, fixed, max_micro_batch=8, say=said.append)
        ranks = [{**vars(rank), "seconds": 0} for rank in chosen.ranks]
        return chosen.setting, {str(c.setting): c.outcome for c in candidates}, ranks, said

    one_at_a_time = choice()
    simulated = []
    not_needed = (Setting(3), 0)

    def one_after_the_other(job: Job, runs: list[tuple[Setting, int]]) -> list:  # where they run is not the claim
        simulated.extend(runs)
        return [MemoryError("killed") if run == not_needed else planner.simulate_rank(job, *run) for run in runs]

    monkeypatch.setattr(planner, "_cores", lambda: 2)
    monkeypatch.setattr(planner, "PARALLEL_AFTER_S", 0.0)
    monkeypatch.setattr(planner, "_simulated_at_once", one_after_the_other)
    beside = choice()
    assert beside[:3] == one_at_a_time[:3]
    assert beside[0].offload_optimizer == "cpu" and beside[0].micro_batch > 1
    assert beside[3][1] == ("simulating stage 3, optimizer on cpu, micro-batch 1, and checking stage 3, "
                            "micro-batch 1 at rank 0 beside it")
    assert not_needed in simulated and len(simulated) == len(set(simulated))


def test_a_checks_ranks_are_offered_to_run_ahead_once_and_never_the_probes_own(monkeypatch):
    """planner._checks_to_come offers, one for each worker, the ranks of the fastest candidate's check at its
    micro-batch, the probe's rank first: not a rank an earlier round already simulated ahead, and not the probe's
    own rank where the check is at the probe's micro-batch (the probe is that rank's result)."""
    from hf_zero.plan import planner

    job = Job("gpt2-tiny", 2, 2, seq_len=32)  # distinct ranks 0, 1 and 3; the probe's is 1
    machine = Machine(10**12)
    probe = plan(job, Setting(3), machine, ranks=[probe_rank(job)])
    monkeypatch.setattr(planner, "_cores", lambda: 3)  # two workers
    open_micro = [planner._judged(probe, machine, None, max_micro_batch=2)]
    at_2 = open_micro[0].setting
    assert at_2 == Setting(3, micro_batch=2)
    assert planner._checks_to_come(job, open_micro, {}) == [(at_2, 1), (at_2, 0)]
    assert planner._checks_to_come(job, open_micro, {(at_2, 1): probe.busiest}) == [(at_2, 0), (at_2, 3)]
    fixed_micro = [planner._judged(probe, machine, 1, max_micro_batch=2)]
    assert planner._checks_to_come(job, fixed_micro, {}) == [(Setting(3), 0), (Setting(3), 3)]


@pytest.mark.usefixtures("each_simulation_once")
def test_a_model_too_large_for_stages_0_to_2_runs_its_first_simulation_beside_the_next(monkeypatch):
    """Stages 0-2 of a model too large for the device whole are said without running the engine, at once
    (simulate._whole_model_over_the_device): no core waits on them. The first simulation, stage 3's, runs beside the
    next candidate where the model's parameter tensors say it will be slow (planner.SECONDS_PER_PARAM_TENSOR each),
    and alone where they do not; the choice is the same either way, and one simulation at a time."""
    import model_zoo
    from hf_zero.plan import planner

    psi = model_zoo.parameter_count("gpt2-tiny")
    job = Job("gpt2-tiny", 1, 2, "bf16", seq_len=32, gpu_memory=2 * psi - 1)

    def choice() -> tuple[dict[str, str], list[str]]:
        said = []
        _, candidates = choose(job, Machine(job.gpu_memory), {}, max_micro_batch=2, say=said.append)
        stage_0 = candidates[0].plan.busiest
        assert stage_0.said_without_engine
        assert stage_0.param_tensors == len(list(model_zoo.build(job.model).parameters()))
        return {str(c.setting): c.outcome for c in candidates}, said

    one_at_a_time, _ = choice()
    monkeypatch.setattr(planner, "_cores", lambda: 2)
    monkeypatch.setattr(planner, "_simulated_at_once",
                        lambda job, runs, *more: [planner.simulate_rank(job, *r) for r in runs])
    monkeypatch.setattr(planner, "PARALLEL_AFTER_S", 1e6)  # slow by the prediction alone, not by a real simulation
    monkeypatch.setattr(planner, "SECONDS_PER_PARAM_TENSOR", planner.PARALLEL_AFTER_S)
    beside, said = choice()
    assert beside == one_at_a_time
    assert said[:4] == ["simulating stage 0, micro-batch 1", "simulating stage 1, micro-batch 1",
                        "simulating stage 2, micro-batch 1",
                        "simulating stage 3, micro-batch 1, and stage 3, micro-batch 1, checkpointing beside it"]
    monkeypatch.setattr(planner, "SECONDS_PER_PARAM_TENSOR", planner.PARALLEL_AFTER_S / 1000)
    alone, said = choice()
    assert alone == one_at_a_time and said[3] == "simulating stage 3, micro-batch 1"


@pytest.mark.usefixtures("each_simulation_once")
def test_nvme_is_chosen_where_the_host_cannot_hold_the_offloaded_states_and_only_where_the_machine_has_it(tmp_path):
    """ZeRO-Infinity: a GPT-2 of 51M on one GPU too small for stage 3 unoffloaded, whose host cannot hold the
    optimizer's states offloaded to it (12 bytes a parameter), trains with them on NVMe; without NVMe nothing fits
    and the answer says NVMe would help; with too little, NVMe's candidates lose for it."""
    from transformers import GPT2Config

    from hf_zero.cli.plan import _what_would

    GPT2Config(n_layer=4, n_embd=1024, n_head=16, vocab_size=256, n_positions=64,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    job = Job(str(tmp_path), 1, 1, seq_len=32)
    fixed = {"zero_stage": 3, "micro_batch": 1, "gradient_checkpointing": False}
    big = Machine(10**12, 10**12, nvme_capacity=10**12)
    measured = {offload: plan(job, Setting(3, *offload), big).busiest
                for offload in [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "none")]}
    device = measured["nvme", "none"].device_peak + 10**6
    host = measured["nvme", "none"].host_peak + 10**6
    assert measured["none", "none"].device_peak > device  # the premise: offload is needed, the host too small for it
    assert min(measured["cpu", "none"].host_peak, measured["cpu", "cpu"].host_peak) > host

    chosen, candidates = choose(job, Machine(device, host, nvme_capacity=10**12), fixed)
    outcomes = {str(c.setting): c.outcome for c in candidates}
    assert chosen is not None and chosen.fits, outcomes
    assert (chosen.setting.offload_optimizer, chosen.setting.offload_param) == ("nvme", "none")
    assert chosen.busiest.nvme_file_bytes == measured["nvme", "none"].nvme_file_bytes > 0
    assert outcomes["stage 3, optimizer on cpu, micro-batch 1"].startswith("host memory:")
    assert outcomes["stage 3, optimizer on nvme, parameters on nvme, micro-batch 1"].startswith(
        "not simulated: fits with less offload")

    chosen, candidates = choose(job, Machine(device, host), fixed)
    assert chosen is None and not any("nvme" in str(c.setting) for c in candidates)
    said = _what_would(job, Machine(device, host), [c.plan for c in candidates if c.plan])
    assert "or NVMe for the offloaded states: hf-zero plan's --nvme" in said

    too_little = measured["nvme", "none"].nvme_file_bytes // 2
    chosen, candidates = choose(job, Machine(device, host, nvme_capacity=too_little), fixed)
    assert chosen is None
    outcomes = {str(c.setting): c.outcome for c in candidates}
    for on_nvme in ("optimizer on nvme", "optimizer on nvme, parameters on nvme"):
        assert outcomes[f"stage 3, {on_nvme}, micro-batch 1"].startswith("NVMe: "), outcomes


@pytest.mark.usefixtures("each_simulation_once")
def test_hpz_is_chosen_where_the_inter_node_link_is_slow_and_its_secondary_copy_fits(tmp_path):
    """ZeRO++'s hpZ over 2 nodes of 2 GPUs: a device too small for stages 0-2 takes stage 3, where hpZ keeps a
    secondary copy of the parameters within each node so that the backward's all-gather stays off the inter-node
    link. Over a slow link that is chosen; over links fast enough that the step is all compute the two tie and plain
    stage 3, the smaller, is; on a device with no room for the secondary copy plain stage 3 is, saying why hpZ lost;
    and on one too small for plain stage 3, hpZ is not even simulated."""
    from transformers import GPT2Config

    # Model states rather than activations decide which stages fit: 256 wide, 16 tokens.
    GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=256, n_positions=16, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    job = Job(str(tmp_path), 2, 2, seq_len=16)
    fixed = {"micro_batch": 1, "gradient_checkpointing": False, "offload_optimizer": "none", "offload_param": "none"}
    big = Machine(10**12)
    plans = {(stage, hpz): plan(job, Setting(stage, hpz_partition_size=hpz), big)
             for stage, hpz in [(1, 1), (2, 1), (3, 1), (3, 2)]}
    measured = {key: planned.busiest for key, planned in plans.items()}
    # The premise: hpZ's secondary copy costs device memory, less than stages 1 and 2 take, and saves inter-node bytes.
    lower_stages = min(measured[1, 1].device_peak, measured[2, 1].device_peak)
    assert measured[3, 1].device_peak < measured[3, 2].device_peak < lower_stages
    assert plans[3, 2].traffic()["inter-node"] < plans[3, 1].traffic()["inter-node"]
    between_hpz_and_lower_stages = (measured[3, 2].device_peak + lower_stages) // 2

    def choice(device: int, **links: float) -> tuple:
        chosen, candidates = choose(job, Machine(device, **links), fixed)
        outcomes = {(c.setting.zero_stage, c.setting.hpz_partition_size): c.outcome for c in candidates}
        assert len(outcomes) == len(candidates) == 5, outcomes  # stages 0-3, and stage 3 with hpZ
        return chosen, outcomes

    chosen, outcomes = choice(between_hpz_and_lower_stages, inter_node_gbps=1e-3)
    assert chosen is not None and (chosen.setting.zero_stage, chosen.setting.hpz_partition_size) == (3, 2), outcomes
    assert outcomes[3, 2] == "chosen" and outcomes[3, 1].startswith("slower: "), outcomes
    assert all(outcomes[stage, 1].startswith("device memory:") for stage in (0, 1, 2)), outcomes
    assert [r.rank for r in chosen.ranks] == distinct_ranks(job)
    assert chosen.traffic()["inter-node"] < plans[3, 1].traffic()["inter-node"]

    chosen, outcomes = choice(between_hpz_and_lower_stages, inter_node_gbps=1e9, intra_node_gbps=1e9)
    assert chosen is not None and (chosen.setting.zero_stage, chosen.setting.hpz_partition_size) == (3, 1), outcomes
    assert outcomes[3, 2] == "as fast, at more device memory", outcomes

    chosen, outcomes = choice((measured[3, 1].device_peak + measured[3, 2].device_peak) // 2, inter_node_gbps=1e-3)
    assert chosen is not None and (chosen.setting.zero_stage, chosen.setting.hpz_partition_size) == (3, 1), outcomes
    assert outcomes[3, 2].startswith("device memory:"), outcomes

    chosen, outcomes = choice(measured[3, 1].device_peak - 1, inter_node_gbps=1e-3)
    assert chosen is None and outcomes[3, 2].startswith("not simulated: without hpZ it takes"), outcomes


def _spawned_interpreters() -> list:
    """This process's children that multiprocessing spawned, as far as they have not exited."""
    import psutil

    found = []
    for child in psutil.Process().children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # exited since it was listed
            pass
    return found


def test_a_worker_that_died_is_replaced_for_the_next_simulation_beside():
    """A worker that dies between rounds (killed for memory, say) breaks its pool: the next simulation side by side
    runs in new workers rather than failing the plan."""
    import os
    from concurrent.futures.process import BrokenProcessPool

    from hf_zero.plan.planner import _Workers

    workers = _Workers()
    with workers:
        died = workers.submit(os._exit, 1)
        with pytest.raises(BrokenProcessPool):
            died.result(timeout=60)
        assert workers.submit(abs, -3).result(timeout=60) == 3
    assert workers.pool is None


def test_the_workers_start_during_a_slow_simulation_only_where_more_could_run_beside_it(monkeypatch):
    """A plan of one rank, by itself (as a bisection over model sizes makes them, one after another), or of two,
    whose second runs here after the first, has nothing to run beside its simulations: however slow, it starts no
    interpreter, which would import for nothing and then be shut down. The same simulation as the first of a plan's
    three distinct ranks (the other two then run at once), or as a candidate of a choice, starts them."""
    import psutil

    from hf_zero.plan import planner

    started = []
    monkeypatch.setattr(planner, "PARALLEL_AFTER_S", 0.0)
    monkeypatch.setattr(planner, "_cores", lambda: 2)
    monkeypatch.setattr(planner._workers, "start", lambda: started.append(True))
    plan(Job("gpt2-tiny", 1, 1, seq_len=32), Setting(3), Machine())
    plan(Job("gpt2-tiny", 1, 2, seq_len=32), Setting(3), Machine())  # ranks 0 and 1
    assert started == []
    plan(Job("gpt2-tiny", 2, 2, seq_len=32), Setting(3), Machine())  # ranks 0, 1 and 3
    assert started == [True]
    with planner._workers:  # inside a choice
        plan(Job("gpt2-tiny", 1, 1, seq_len=32), Setting(3), Machine())
    assert started == [True, True]
    assert not psutil.wait_procs(_spawned_interpreters(), timeout=30)[1]


@pytest.mark.parametrize("first_build", ["waits for a core", "computes"])
def test_a_simulation_is_slow_by_its_cpu_time_not_by_the_time_a_busy_machine_adds(monkeypatch, first_build):
    """A simulation with more to come whose thread waits (as on a machine whose cores run other work: its model build
    sleeps 1.5 s) is not slow however long it takes by the clock, and starts no workers, which would only add to that
    work; the same simulation computing for 1.5 s is, and starts them. The rank's `seconds` are its CPU time."""
    from hf_zero.plan import planner, simulate

    job = Job("gpt2-tiny", 2, 2, seq_len=32)
    simulate.simulate_rank(job, Setting(3), 0)  # the first simulation in a process imports: about 2 s of a core
    started, delayed = [], []
    build_really = simulate.build_model

    def build_model(*args, **kwargs):
        if not delayed:
            delayed.append(True)
            if first_build == "waits for a core":
                time.sleep(1.5)
            else:  # 1.5 s of this thread's CPU, however long the suite's other work makes that take
                until = time.thread_time() + 1.5
                while time.thread_time() < until:
                    pass
        return build_really(*args, **kwargs)

    monkeypatch.setattr(simulate, "build_model", build_model)
    monkeypatch.setattr(planner, "PARALLEL_AFTER_S", 1.0)  # a tiny model's simulation takes about 0.2 s of a core
    monkeypatch.setattr(planner, "_cores", lambda: 2)
    monkeypatch.setattr(planner._workers, "start", lambda: started.append(True))
    with planner._workers:  # inside a plan or choice: the workers it starts are shut down at its end
        first = planner._simulated_at_once(job, [(Setting(3), 0)], more_to_come=True)[0]
    if first_build == "waits for a core":
        assert started == [] and first.seconds < 1.0, first.seconds
    else:
        assert started == [True] and first.seconds >= 1.5, first.seconds
