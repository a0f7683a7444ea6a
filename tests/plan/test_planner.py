"""Choosing among settings (hf_zero.plan.planner.choose): what may be skipped without simulation, against the
simulated settings themselves."""
from hf_zero.plan.machine import Machine
from hf_zero.plan.planner import choose, plan, probe_rank
from hf_zero.plan.simulate import Job, Setting

MICRO = 16


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


def test_ranks_simulated_side_by_side_in_other_processes_are_the_ranks_simulated_here():
    """A large model's remaining ranks run in spawned interpreters at once (planner._side_by_side): each holds and
    sends exactly what the same rank simulated in this process does."""
    from dataclasses import asdict

    from hf_zero.plan.planner import _side_by_side
    from hf_zero.plan.simulate import simulate_rank

    job, setting = Job("gpt2-tiny", 2, 2, seq_len=32), Setting(3, micro_batch=2, hpz_partition_size=2)
    apart = _side_by_side(job, setting, [1, 3], None)
    here = [simulate_rank(job, setting, rank) for rank in (1, 3)]
    assert [{**asdict(s), "seconds": 0} for s in apart] == [{**asdict(s), "seconds": 0} for s in here]
    assert apart[1].sent["inter-node"] > 0  # rank 3's ring crosses to node 0


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
