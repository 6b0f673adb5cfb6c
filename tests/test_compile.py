"""`compile=True`: decoding steps padded to a few fixed heights (the attended length a dynamic size) and
run through `torch.compile` of the model. Padding must change nothing, the compiled path must be the one that runs,
and a compiler failure must leave a warning and an eager run with the same output."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model, random_tree_step, reference_greedy, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

import lookahead.hf
import lookahead.kernels
from lookahead import LookaheadConfig, generate
from lookahead.config import PLAIN_CONFIG
from lookahead.costs import CostCurve
from lookahead.engine import Engine, RequestParams
from lookahead.hf import COMPILED_HEIGHTS, HFModelRunner
from lookahead.quant import quantise_weights
from lookahead.runtime.batch import StepInput, after_tokens, causal_step, pack_steps, pad_batch


@settings(max_examples=100)  # each example runs three forwards
@given(seed=st.integers(0, 2**16), sizes=st.lists(st.integers(1, 7), min_size=1, max_size=3),
       others=st.integers(0, 2), order=st.randoms())
def test_padding_a_step_changes_no_logit(llama_tiny, seed, sizes, others, order):
    """The real rows of a step padded to a taller height, to the store's whole capacity and to the first
    slots (other sequences' slots, and empty ones, getting padding rows only) get the logits they get
    unpadded (eager, so that only the padding differs), for sequences of different lengths in any slots."""
    generator = torch.Generator().manual_seed(seed)
    runner = HFModelRunner(llama_tiny, packed_linear=False)
    runner.ragged_steps = False  # the padding computed, as compiled steps compute it
    every = list(range(len(sizes) + others))
    lengths = [int(torch.randint(1, 20, (1,), generator=generator)) for _ in every]
    stores = [runner.new_store(len(every), 64) for _ in range(2)]
    prompts = [causal_step(torch.randint(3, 128, (n,), generator=generator)) for n in lengths]
    for store in stores:
        for slot, prompt in zip(every, prompts):
            runner.forward(store, pack_steps([slot], [0], [prompt]))
            store.extend(slot, prompt.tokens.numel())
        store.release(every[-1])  # an empty slot: padded, or starting a sequence
    lengths[-1] = 0
    slots = order.sample(every, len(sizes))
    batch = pack_steps(slots, [lengths[s] for s in slots], [random_tree_step(n, generator) for n in sizes])
    plain = runner.forward(stores[0], batch)
    padded = runner.forward(stores[1], pad_batch(batch, lengths, 8, 64, every))
    torch.testing.assert_close(padded[torch.tensor(slots)], plain, rtol=1e-5, atol=1e-5)


def test_padding_rows_stay_at_the_last_position_and_see_their_own_key_alone():
    """A padding row repeats its sequence's last position (never past it: out of a model's context, or a longrope
    model's scaling chosen from the largest position) and its own key has that position, inside any sliding
    window; the rows pad_batch adds see that key alone."""
    batch = pack_steps([0, 1], [4, 2], [causal_step(torch.tensor([5, 6, 7])), causal_step(torch.tensor([8]))])
    assert batch.positions.tolist() == [[4, 5, 6], [2, 2, 2]]
    padded = pad_batch(batch, [4, 2], 4, 10)
    assert padded.positions.tolist() == [[4, 5, 6, 6], [2, 2, 2, 2]]
    for b, (start, size) in enumerate(zip([4, 2], batch.sizes)):
        for row in range(size, 4):
            own = start + row
            assert padded.visible[b, row, own] and padded.key_positions[b, own] == padded.positions[b, row]
            if row >= batch.height:
                assert padded.visible[b, row].nonzero().flatten().tolist() == [own]


def test_tokens_put_before_a_step_form_a_causal_prefix_that_every_row_of_the_step_sees():
    """Lookahead parallelism feeds the committed tokens a process has not computed in front of its step."""
    step = StepInput(torch.tensor([7, 8, 9]), torch.tensor([0, 1, 1]),
                     torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), torch.tensor([1, 2]))
    joined = after_tokens(torch.tensor([4, 5]), step)
    assert joined.tokens.tolist() == [4, 5, 7, 8, 9] and joined.offsets.tolist() == [0, 1, 2, 3, 3]
    assert joined.allowed.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                             [1, 1, 1, 0, 1]]
    assert joined.logit_rows.tolist() == [3, 4]
    assert after_tokens(torch.tensor([], dtype=torch.long), step) is step


def test_pad_batch_refuses_a_shape_it_cannot_reach():
    batch = pack_steps([0], [10], [causal_step(torch.arange(3, 7))])
    with pytest.raises(ValueError, match="cannot pad a step of 4 rows over 14 columns to 2 x 64"):
        pad_batch(batch, [10], 2, 64)
    with pytest.raises(ValueError, match="to 8 x 16"):
        pad_batch(batch, [10], 8, 16)  # 10 cached + 8 rows do not fit 16 columns
    with pytest.raises(ValueError, match="over slots"):
        pad_batch(batch, [10], 8, 64, slots=[1])  # the slots must include the batch's


@pytest.mark.slow  # compiling takes seconds per step shape
def test_compiled_steps_give_greedy_generate_output():
    """Greedy decoding through the compiled forward, with lookahead (auto, and a fixed tree with a window)
    in a batch of two prompts of different lengths, equals transformers' `generate` of each, on Gemma 3
    (sliding and full layers: two masks, both dynamic), its linear layers MKL-packed; the compiled heights
    are the ones that ran. (The CLI test below compiles a Llama, on the linears the cost curve picks.)"""
    model = make_tiny_model("gemma3")
    engine = Engine(model, max_batch=2, max_length=64, compile=True, packed_linear=True)
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]
    configs = [None, LookaheadConfig(window=3, ngram=3, guesses=3)]
    ids = {engine.add_request(p, RequestParams(24, config)): (p, config) for p, config in zip(prompts, configs)}
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].extend(output.tokens)
    for request_id, (prompt, config) in ids.items():
        expected = reference_greedy(model, prompt.view(1, -1), 24)[0, prompt.numel():].tolist()
        assert outputs[request_id] == expected, config
    assert engine.runner.compile_seconds and {h for h, _ in engine.runner.compile_seconds} <= set(COMPILED_HEIGHTS)
    assert engine.stats.compile_seconds == pytest.approx(sum(engine.runner.compile_seconds.values()))


def test_a_compiler_failure_warns_and_runs_eagerly(llama_tiny, monkeypatch):
    def failing(model, mode, how):
        def forward(model, **kwargs):
            raise RuntimeError("no compiler here")
        return forward

    monkeypatch.setattr(lookahead.hf, "_compiled_forward", failing)
    prompt = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    with pytest.warns(RuntimeWarning, match=r"torch.compile failed for steps of \d+ rows of one sequence; they run eagerly: "
                                            "RuntimeError: no compiler here"):
        out = generate(llama_tiny, prompt, max_new_tokens=12, config=LookaheadConfig(window=0, guesses=0),
                       compile=True)
    assert torch.equal(out.sequences, reference_greedy(llama_tiny, prompt, 12))


def _linear_ops_of_a_compiled_step(runner: HFModelRunner, prompt: torch.Tensor, rows: int) -> list[str]:
    """The linear ops a compiled step of `rows` rows after `prompt` runs (it compiles first)."""
    from torch.profiler import profile

    store = runner.new_store(1, 64)
    runner.forward(store, pack_steps([0], [0], [causal_step(prompt[0])]))  # eager: the prompt
    store.extend(0, prompt.numel())
    step = pack_steps([0], [prompt.numel()], [causal_step(torch.arange(3, 3 + rows))])
    runner.forward(store, step)  # compiles
    with profile() as profiled:
        runner.forward(store, step)
    linear_ops = ("lookahead::linear_f32", "lookahead::linear_q4", "mkldnn::_linear_pointwise", "aten::mm",
                  "aten::addmm", "aten::linear", "mkl::_mkl_linear")
    return [event.name for event in profiled.events() if event.name in linear_ops]


def test_a_step_shape_that_fails_to_compile_later_in_a_run_runs_eagerly(llama_tiny, monkeypatch):
    """Steps of one sequence compiled, the first step of several at the same height fails to compile (dynamo
    compiles one sequence apart): it warns and runs eagerly, as a failure on the first step of all does, and
    every output is transformers' greedy output."""
    def one_sequence_only(model, mode, how):
        def forward(model, **kwargs):
            if kwargs["input_ids"].shape[0] > 1:
                raise RuntimeError("no compiler for several")
            return model(**kwargs)
        return forward

    monkeypatch.setattr(lookahead.hf, "_compiled_forward", one_sequence_only)
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 6)]
    # (Where no cost curve is stored yet, the engine's first measurements of several sequences meet it.)
    with pytest.warns(RuntimeWarning, match=r"compile failed for steps of \d+ rows of several sequences; they run eagerly"):
        engine = Engine(llama_tiny, max_batch=2, max_length=64, compile=True)
        first = engine.add_request(prompts[0], RequestParams(12, PLAIN_CONFIG))
        outputs = {first: []}
        for _ in range(4):
            for output in engine.step():
                outputs[output.request_id].extend(output.tokens)
        assert (1, False) in engine.runner.compile_seconds
        second = engine.add_request(prompts[1], RequestParams(12, PLAIN_CONFIG))
        outputs[second] = []
        while engine.has_unfinished():
            for output in engine.step():
                outputs[output.request_id].extend(output.tokens)
    assert any(several for _, several in engine.runner._eager_shapes)
    for request_id, prompt in zip((first, second), prompts):
        assert outputs[request_id] == reference_greedy(llama_tiny, prompt.view(1, -1), 12)[0, prompt.numel():].tolist()


@pytest.mark.slow  # compiling takes seconds per step shape
@pytest.mark.skipif(lookahead.kernels.library() is None, reason="our kernel does not build or run here")
def test_compiled_steps_on_a_cpu_call_our_kernel_from_the_graph(llama_tiny):
    """Where our kernel runs, a compiled step (one row too) calls it as an op of the graph on our packs, a
    stacked call for the linears that share an input, nothing frozen; greedy decoding so gives `generate`'s
    output."""
    runner = HFModelRunner(llama_tiny, compile=True)
    assert runner.compiled_kernel and not runner.freezes and runner.compiled_heights == COMPILED_HEIGHTS
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    out = generate(llama_tiny, prompt, max_new_tokens=16, config=PLAIN_CONFIG, compile=True)
    assert torch.equal(out.sequences, reference_greedy(llama_tiny, prompt, 16))
    layers = llama_tiny.config.num_hidden_layers
    for rows in (1, 3):
        # Per layer: q/k/v stacked, o, gate/up stacked, down; then the output layer.
        assert _linear_ops_of_a_compiled_step(runner, prompt, rows) == ["lookahead::linear_f32"] * (4 * layers + 1)
    assert set(runner.compile_seconds) == {(1, False), (4, False)}


@pytest.mark.slow  # compiling takes seconds per step shape
@pytest.mark.skipif(not lookahead.kernels.runs_q4(), reason="our 4-bit kernel needs AVX-512 BF16")
def test_compiled_int4_steps_call_our_4_bit_kernel_from_the_graph(llama_tiny):
    """With int4 weights, compiled steps (one row too) call our 4-bit kernel as an op of the graph, the layers
    that share an input stacked, nothing frozen; greedy decoding so gives the eager output."""
    model = quantise_weights(copy.deepcopy(llama_tiny), "int4")
    runner = HFModelRunner(model, compile=True)
    assert runner.compiled_kernel and not runner.freezes and runner.compiled_heights == COMPILED_HEIGHTS
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    eager = generate(model, prompt, max_new_tokens=16, config=PLAIN_CONFIG)
    assert torch.equal(generate(model, prompt, max_new_tokens=16, config=PLAIN_CONFIG, compile=True).sequences,
                       eager.sequences)
    layers = model.config.num_hidden_layers
    assert _linear_ops_of_a_compiled_step(runner, prompt, 1) == ["lookahead::linear_q4"] * (4 * layers)


@pytest.mark.slow  # compiling takes seconds per step shape
def test_compiled_steps_on_a_cpu_run_the_frozen_weights_packed_by_inductor(llama_tiny, monkeypatch):
    """Compiled on a CPU where our kernel does not run, a step runs every linear layer on a copy of its weight
    that inductor froze and packed with oneDNN (the rows a dynamic size: one-row steps are padded to two), none
    through the model's own weights or our eager packs; greedy decoding so gives `generate`'s output."""
    monkeypatch.setattr(lookahead.kernels, "library", lambda: None)
    runner = HFModelRunner(llama_tiny, compile=True, packed_linear=True)
    assert runner.freezes and runner.compiled_heights == COMPILED_HEIGHTS[1:]
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    out = generate(llama_tiny, prompt, max_new_tokens=16, config=PLAIN_CONFIG, compile=True, packed_linear=True)
    assert torch.equal(out.sequences, reference_greedy(llama_tiny, prompt, 16))
    linears = sum(type(m) is torch.nn.Linear for m in llama_tiny.modules())
    assert _linear_ops_of_a_compiled_step(runner, prompt, 1) == ["mkldnn::_linear_pointwise"] * linears
    assert set(runner.compile_seconds) == {(2, False)}


@pytest.mark.slow  # the C++ wrapper compiles for seconds more per step shape
def test_compiled_with_a_cpp_wrapper_decodes_as_generate_does(llama_tiny):
    """compile="cpp-wrapper" (the compiled kernels called from C++, not Python) gives `generate`'s greedy
    output, with MKL-packed linears (our op called from the C++ code). One-row steps only, one graph: the
    C++ wrapper is an inductor option on the same graphs, whose step shapes the default mode's tests cover."""
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    out = generate(llama_tiny, prompt, max_new_tokens=24, config=LookaheadConfig(window=0, guesses=0),
                   compile="cpp-wrapper", packed_linear=True)
    assert torch.equal(out.sequences, reference_greedy(llama_tiny, prompt, 24))
    assert out.stats.compile_seconds > 0


def test_the_budget_prices_a_step_at_its_padded_height():
    curve = CostCurve([1, 2, 4, 8], [1.0, 1.1, 1.3, 2.0], padded_to=(1, 2, 4, 8))
    assert curve(3) == curve(4) == pytest.approx(1.3)
    assert curve(5) == pytest.approx(2.0)
    assert CostCurve([1, 2, 4, 8], [1.0, 1.1, 1.3, 2.0])(3) == pytest.approx(1.2)


@pytest.mark.slow
def test_cli_generate_compiles_and_says_how_long_it_took(tiny_dir):
    result = run_cli("generate", "def add(a, b):", "--raw", "--model", tiny_dir, "--max-new-tokens", "6",
                     "--window", "0", "--guesses", "0", "--compile")
    assert result.returncode == 0, result.stderr
    assert "[6 new tokens," in result.stderr and "s of it compiling" in result.stderr
    for option in ("--compile", "--cpp-wrapper"):
        refused = run_cli("generate", "hello", "--model", tiny_dir, option, "--workers", "2")
        assert refused.returncode == 2 and "--compile/--cpp-wrapper runs in one process" in refused.stderr


@pytest.mark.slow
def test_bench_runs_each_of_our_methods_also_compiled(tiny_dir, tmp_path):
    result = run_cli("bench", "--model", tiny_dir, "--dataset", "humaneval", "--raw", "--limit", "1",
                     "--max-new-tokens", "6", "--baselines", "greedy,plain", "--config", "0,3,2", "--compile",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert {r["method"] for r in runs} == {"greedy", "plain", "lookahead-W0N3G2", "plain-compiled",
                                           "lookahead-W0N3G2-compiled"}
    assert all(r["identical"] is True for r in runs)  # compiled or not, token-identical to greedy


@pytest.mark.slow  # compiles a tiny model's steps
def test_bench_cost_times_the_eager_and_the_compiled_steps_side_by_side(tiny_dir, tmp_path):
    result = run_cli("bench", "cost", "--model", tiny_dir, "--max-k", "4", "--repeats", "1", "--context", "16",
                     "--compile", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert list(cost["curves"]) == ["eager", "compiled"] and cost["points"] == cost["curves"]["compiled"]
    assert all([p["tokens"] for p in curve] == [1, 2, 4] and all(p["seconds"] > 0 for p in curve)
               for curve in cost["curves"].values())
    assert "| k | eager: ms | T(k)/T(1) | compiled: ms | T(k)/T(1) | compiled / eager |" in result.stdout


def test_a_time_above_a_taller_steps_time_is_noise_and_is_lowered_to_it():
    assert CostCurve([1, 2, 4, 8], [3.0, 2.0, 5.0, 4.0]).relative == [1.0, 1.0, 2.0, 2.0]


def test_each_size_costs_its_fastest_time_the_sizes_timed_in_turn(llama_tiny, monkeypatch):
    """A burst of another process on the cores adds time to whatever runs then: sizes are timed in turn,
    round after round, short steps (up to 8 rows) three times a round, and each size keeps its fastest time
    (the warm-up pass, here the fastest, not counted)."""
    import lookahead.costs as costs

    order, sizes = [], (1, 2, 16)
    scripted = iter([0.1, 0.1, 0.1,  # warm-up pass
                     5.0, 9.0, 9.0, 4.0, 9.0, 3.0, 9.0,  # a burst on size 2
                     2.0, 3.0, 30.0, 2.5, 2.7, 2.2, 2.9,  # a burst on size 16
                     2.5, 2.6, 4.0, 2.1, 3.0, 2.4, 2.8])

    def timed(run, device):
        order.append(run.args[1].height)
        return next(scripted)

    monkeypatch.setattr(costs, "timed_seconds", timed)
    points = costs.forward_cost(HFModelRunner(llama_tiny), context=8, sizes=sizes, repeats=3)
    assert order == [1, 2, 16] + [1, 2, 16, 1, 2, 1, 2] * 3
    assert [(p.tokens, p.seconds) for p in points] == [(1, 2.0), (2, 2.6), (16, 4.0)]
    assert [p.relative for p in points] == [1.0, 1.3, 2.0]


def test_the_linear_paths_are_timed_in_turn_too(llama_tiny, monkeypatch):
    """Two linear paths measured one after the other would differ by the machine's drift: within each round
    every path times every size, and each (path, size) keeps its fastest time."""
    import lookahead.costs as costs

    runner = HFModelRunner(llama_tiny)
    order, scripted = [], iter([1.0] * 4 + [3.0, 5.0, 4.0, 6.0] * 3 * 2 + [2.0, 4.0, 5.0, 7.0] * 3 * 3)

    def timed(run, device):
        run()
        order.append(runner.packer)
        return next(scripted)

    monkeypatch.setattr(costs, "timed_seconds", timed)
    assert costs._seconds(runner, [None, "mkl"], sizes=(1, 2)) == {None: [2.0, 4.0], "mkl": [4.0, 6.0]}
    assert order == [None, None, "mkl", "mkl"] * (1 + 3 * 5)


@pytest.fixture
def costs(monkeypatch, tmp_path):
    """`lookahead.costs` with nothing measured before the test and an eager curve of 10, 11, 13, 20 ms for
    steps of 1, 2, 4, 8 tokens."""
    import lookahead.costs as costs

    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_MEASURED", {})
    monkeypatch.setattr(costs, "_ONE_ROW_NOW", {})
    monkeypatch.setattr(costs, "CURVE_SIZES", (1, 2, 4, 8))
    monkeypatch.setattr(costs, "_seconds", lambda runner, packers, sizes=():
                        {packer: [10.0, 11.0, 13.0, 20.0] for packer in packers})
    return costs


def test_a_curve_stored_while_the_machine_was_busy_is_measured_again(llama_tiny, costs, tmp_path, monkeypatch):
    """Read from disk, a curve whose one-row step takes over 1/0.85 of what one takes now was measured under
    another load (and its ratios with it): it is measured again and rewritten. One that no step now beats by
    that much is kept."""
    runner = HFModelRunner(llama_tiny, packed_linear=False)
    path = tmp_path / "costs" / f"{costs._curve_key(runner)}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"sizes": [1, 2, 4, 8], "plain": [40.0, 60.0, 90.0, 100.0]}))
    monkeypatch.setattr(costs, "timed_seconds", lambda run, device: 12.0)  # a one-row step now
    assert costs.cost_curve(runner).relative == [1.0, 1.1, 1.3, 2.0]  # the fixture's measurement
    assert json.loads(path.read_text())["plain"] == [10.0, 11.0, 13.0, 20.0]

    monkeypatch.setattr(costs, "_MEASURED", {})  # another process
    monkeypatch.setattr(costs, "_ONE_ROW_NOW", {})
    path.write_text(json.dumps({"sizes": [1, 2, 4, 8], "plain": [13.5, 15.0, 27.0, 30.0]}))
    assert costs.cost_curve(runner).relative == [1.0, 15 / 13.5, 2.0, 30 / 13.5]
    assert json.loads(path.read_text())["plain"] == [13.5, 15.0, 27.0, 30.0]


def test_a_packing_runner_reads_no_plain_times_from_a_stored_curve(llama_tiny, costs, tmp_path, monkeypatch):
    """A runner told to pack never runs the plain path, and its stored curve is checked without plain times: a
    file whose plain times were cut short (edited, or corrupt) had made a curve of one time, which failed at the
    first step sized by it; plain times of any length could turn the packing off."""
    runner = HFModelRunner(llama_tiny, packed_linear=True)
    packer = runner.packers[0]
    path = tmp_path / "costs" / f"{costs._curve_key(runner)}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"sizes": [1, 2, 4, 8], "plain": [1.0], packer: [10.0, 11.0, 13.0, 20.0]}))
    monkeypatch.setattr(costs, "timed_seconds", lambda run, device: 10.0)  # a one-row step now, as stored
    curve = costs.cost_curve(runner)
    assert curve.relative == [1.0, 1.1, 1.3, 2.0] and curve(4) == 1.3 and runner.packer == packer
    with pytest.raises(ValueError, match="a positive time for each"):
        costs.CostCurve([1, 2, 4], [1.0, 2.0])


def test_a_measurement_says_so_on_stderr_and_a_stored_one_does_not(llama_tiny, costs, tmp_path, capsys):
    """A first call sat silent while it timed the model's steps (over two minutes on a busy 2-core machine): a
    new user took it for frozen. Now one line says what is timed and where it is kept; a later process reads the
    file and says nothing."""
    runner = HFModelRunner(llama_tiny, packed_linear=False)
    costs.cost_curve(runner)
    assert capsys.readouterr().err == (f"lookahead: timing this model's steps on cpu, once; kept in "
                                       f"{tmp_path.resolve() / 'costs'}\n")
    costs._MEASURED.clear()  # another process
    costs.cost_curve(runner)
    assert capsys.readouterr().err == ""


def test_stored_batch_curves_are_checked_against_one_probe_per_process(llama_tiny, costs, tmp_path, monkeypatch):
    """A batch curve keeps the one-row step of one sequence timed in its rounds; a process times that step
    once (or takes it from the curve it has just measured) and measures again each batch curve stored with
    over 1/0.85 of it, keeping the others: one probe for every batch size, not one each."""
    runner = HFModelRunner(llama_tiny, packed_linear=False)
    timed = []
    monkeypatch.setattr(costs, "timed_seconds", lambda run, device: timed.append(run) or 12.0)
    monkeypatch.setattr(costs, "_step_seconds", lambda runner, sizes, batch:
                        {"sizes": list(sizes), "seconds": [20.0, 30.0, 40.0, 50.0], "one_row": 10.0})

    def stored(batch: int, one_row: float) -> Path:
        path = tmp_path / "costs" / f"{costs._curve_key(runner)}-None-b{batch}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"sizes": [1, 2, 4, 8], "seconds": [40.0, 50.0, 60.0, 70.0], "one_row": one_row}))
        return path

    def seconds(path: Path) -> list[float]:
        return json.loads(path.read_text())["seconds"]

    busy, quiet = stored(2, 15.0), stored(4, 11.0)
    costs.cost_curve(runner)  # measured here (10 ms a row): nothing to probe
    assert costs.batch_cost_curve(runner, 2).relative == [1.0, 1.5, 2.0, 2.5] and seconds(busy)[0] == 20.0
    assert costs.batch_cost_curve(runner, 4).relative == [1.0, 1.25, 1.5, 1.75] and seconds(quiet)[0] == 40.0
    assert timed == []

    monkeypatch.setattr(costs, "_MEASURED", {})  # another process, which finds a row at 12 ms
    monkeypatch.setattr(costs, "_ONE_ROW_NOW", {})
    busy, quiet = stored(2, 15.0), stored(4, 14.0)
    for batch in (1, 2, 4):
        costs.batch_cost_curve(runner, batch)
    assert seconds(busy)[0] == 20.0 and seconds(quiet)[0] == 40.0
    assert len(timed) == 1 + 3
    other = stored(8, 10.0)  # a curve of other heights (stored before a change of them): measured again
    other.write_text(json.dumps({"sizes": [1, 2], "seconds": [40.0, 50.0], "one_row": 10.0}))
    assert costs.batch_cost_curve(runner, 8).sizes == [1, 2, 4, 8] and seconds(other)[0] == 20.0  # one probe: its warm-up and 3 rounds


def test_a_curve_is_measured_by_one_process_at_a_time(llama_tiny, costs, tmp_path):
    """Two callers wanting the same curve at once (threads here, test workers or servers in practice): one
    measures, the other waits and reads what it wrote, instead of measuring under the first one's load."""
    import threading

    calls = []

    def measure():
        calls.append(threading.get_ident())
        time.sleep(0.3)
        return {"seconds": [1.0, 2.0]}

    path = tmp_path / "costs" / "curve.json"
    results = []
    runner = HFModelRunner(llama_tiny)
    threads = [threading.Thread(target=lambda: results.append(costs._stored(path, measure, runner, lambda m: True)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and results == [{"seconds": [1.0, 2.0]}] * 2
    assert json.loads(path.read_text()) == {"seconds": [1.0, 2.0]}


@pytest.mark.parametrize("content", [
    "", '{"sizes": [1, 2, 4', "[]", '{"sizes": [1, 2, 4, 8]}', '{"sizes": [1, 2, 4, 8], "plain": [0, 0, 0, 0]}',
    '{"sizes": [1, 2, 4, 8], "plain": [NaN, 11, 13, 20]}', '{"sizes": [1, 2, 4, 8], "plain": [10, 11]}',
    '{"sizes": [2, 1, 4, 8], "plain": [10, 11, 13, 20]}', '{"sizes": [1, 2, 4, 8], "plain": ["10", 11, 13, 20]}',
])
def test_a_stored_curve_cut_short_or_edited_is_measured_again(llama_tiny, costs, tmp_path, monkeypatch, content):
    """A cost file that is not a curve of this runner's paths (cut short by a full disk, edited, of another
    layout) is as good as none: measured again and rewritten, not an error in every later run."""
    runner = HFModelRunner(llama_tiny, packed_linear=False)
    path = tmp_path / "costs" / f"{costs._curve_key(runner)}.json"
    path.parent.mkdir()
    path.write_text(content)
    assert costs.cost_curve(runner).relative == [1.0, 1.1, 1.3, 2.0]  # the fixture's measurement
    assert json.loads(path.read_text())["plain"] == [10.0, 11.0, 13.0, 20.0]
    batch = tmp_path / "costs" / f"{costs._path_key(runner)}-b2.json"
    batch.write_text(content.replace("plain", "seconds"))
    measured = {"sizes": [1, 2], "seconds": [20.0, 30.0], "one_row": 10.0}
    monkeypatch.setattr(costs, "_step_seconds", lambda runner, sizes, batch: measured)
    assert costs.batch_cost_curve(runner, 2).relative == [1.0, 1.5]
    assert json.loads(batch.read_text()) == measured


def test_a_cache_folder_that_cannot_be_written_keeps_the_curves_in_memory(llama_tiny, costs, tmp_path, monkeypatch):
    """Where $LOOKAHEAD_CACHE cannot hold the curves (a file there, a read-only folder), decoding measures
    them, warns once, and goes on, exact."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path / "a-file"))
    runner = HFModelRunner(llama_tiny, packed_linear=False)
    with pytest.warns(RuntimeWarning, match="cost curves not kept, .* is not writable"):
        assert costs.cost_curve(runner).relative == [1.0, 1.1, 1.3, 2.0]
    prompt = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="cost curves not kept"):  # the batch curves' files, likewise
        out = generate(llama_tiny, prompt, max_new_tokens=16)
    assert out.sequences.tolist() == reference_greedy(llama_tiny, prompt, 16).tolist()


def test_a_stored_curve_is_checked_on_the_path_it_chose(llama_tiny, monkeypatch, costs, tmp_path):
    """The probe that decides whether a stored curve was measured on a busy machine times the linear path
    the curve chose (here a packer from one row), not the plain one: a packed one-row step stored at 20 ms
    that now takes 5 ms is measured again, although the plain path takes 25 ms now."""
    monkeypatch.setattr(lookahead.hf.PackedLinears, "packers", staticmethod(lambda model: ("mkl",)))
    runner = HFModelRunner(llama_tiny)
    path = tmp_path / "costs" / f"{costs._curve_key(runner)}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"sizes": [1, 2, 4, 8], "plain": [30.0, 31.0, 33.0, 40.0],
                                "mkl": [20.0, 21.0, 23.0, 30.0]}))
    monkeypatch.setattr(costs, "timed_seconds", lambda run, device: 5.0 if runner.packer == "mkl" else 25.0)
    costs.cost_curve(runner)
    assert json.loads(path.read_text())["mkl"] == [10.0, 11.0, 13.0, 20.0]  # the fixture's measurement


def test_the_cost_curve_is_keyed_by_the_attention_implementation(costs):
    """Eager attention and SDPA run different kernels: a curve timed on one does not price the other."""
    eager, sdpa = (make_tiny_model("llama") for _ in range(2))
    eager.config._attn_implementation, sdpa.config._attn_implementation = "eager", "sdpa"
    assert costs._curve_key(HFModelRunner(eager)) != costs._curve_key(HFModelRunner(sdpa))


def test_the_cost_curve_is_keyed_by_the_cpu(costs, monkeypatch):
    """Curves timed on another CPU (a cache folder shared across machines) are not read: its model name, its
    flags and its core count each name the curve, on a machine where no kernel of ours tells the CPUs apart."""
    monkeypatch.setattr(costs.kernels, "library", lambda: None)
    runner = HFModelRunner(make_tiny_model("llama"))
    here, fields = costs._curve_key(runner), costs.cpu_fields()
    assert costs._curve_key(runner) == here
    for name in ("model name", "flags"):
        monkeypatch.setattr(costs, "cpu_fields", lambda: {**fields, name: "another CPU's"})
        assert costs._curve_key(runner) != here, name
    monkeypatch.setattr(costs, "cpu_fields", lambda: fields)
    monkeypatch.setattr(costs.os, "cpu_count", lambda: 1024)
    assert costs._curve_key(runner) != here


MKL_TIMES = [10.5, 11.5, 11.0, 14.0]  # faster than the plain path from 4 rows on
ONEDNN_TIMES = [12.0, 12.0, 13.5, 15.0]  # from 8 only
SLOW_TIMES = [12.0, 10.0, 14.0, 21.0]  # at 2 rows only


@pytest.mark.parametrize("times, packer, packed_from, relative", [
    ({"mkl": MKL_TIMES, "onednn": ONEDNN_TIMES}, "mkl", 4, [1.0, 1.1, 1.1, 1.4]),
    ({"onednn": ONEDNN_TIMES}, "onednn", 8, [1.0, 1.1, 1.3, 1.5]),
    ({"mkl": SLOW_TIMES}, None, None, [1.0, 1.1, 1.3, 2.0]),  # never taken
    ({}, None, None, [1.0, 1.1, 1.3, 2.0]),
])
def test_the_cost_curve_picks_the_packer_and_the_height_it_pays_from(llama_tiny, monkeypatch, costs, times, packer,
                                                                      packed_from, relative):
    """Scripted times: plain 10, 11, 13, 20 ms for 1, 2, 4, 8 rows; a packer takes over from the height
    where it is faster at that height and every larger one; of two, the one with the lower curve."""
    packers = tuple(times)
    times = {None: [10.0, 11.0, 13.0, 20.0], **times}
    monkeypatch.setattr(costs, "_seconds", lambda runner, packers, sizes=():
                        {packer: times[packer] for packer in packers})
    monkeypatch.setattr(lookahead.hf.PackedLinears, "packers", staticmethod(lambda model: packers))
    runner = HFModelRunner(llama_tiny)
    for each in packers:  # measuring packs with each packer; the packs of those not taken are freed
        runner.use_packed(each)
    assert costs.cost_curve(runner).relative == pytest.approx(relative)
    assert (runner.packer, runner.packed_from) == (packer, packed_from)
    assert set(lookahead.hf._PACKED.get(llama_tiny, {})) == ({packer} - {None})


def test_a_packer_is_offered_only_where_its_copy_fits_in_half_the_free_memory(llama_tiny, monkeypatch):
    """MKL's packs take twice the bytes of the float32 weights, oneDNN's and ours once; bfloat16 weights get
    oneDNN's only; ours where it builds here."""
    weights = sum(m.weight.nbytes for m in llama_tiny.modules() if type(m) is torch.nn.Linear)
    native = ("native",) if lookahead.kernels.library() is not None else ()
    for free, packers in [(4 * weights, ("mkl", "onednn", *native)), (3 * weights, ("onednn", *native)), (weights, ())]:
        monkeypatch.setattr(lookahead.hf, "available_memory", lambda: free)
        assert lookahead.hf.PackedLinears.packers(llama_tiny) == packers
    with pytest.raises(ValueError, match="free memory for a packed copy of its linear weights"):
        HFModelRunner(llama_tiny, packed_linear=True)
    monkeypatch.setattr(lookahead.hf, "available_memory", lambda: 4 * weights)
    assert lookahead.hf.PackedLinears.packers(make_tiny_model("llama").to(torch.bfloat16)) == ("onednn",)


def test_compiled_cpu_steps_freeze_the_weights_only_where_two_copies_fit_in_half_the_free_memory(llama_tiny,
                                                                                                 monkeypatch):
    """Frozen (where our kernel does not run), every graph keeps a packed copy of the weights (two graphs) and
    steps start at two rows; where that does not fit, steps compile unfrozen from one row. Eager runners freeze
    nothing."""
    monkeypatch.setattr(lookahead.kernels, "library", lambda: None)
    weights = lookahead.hf.linear_bytes(llama_tiny)
    for free, freezes, heights in [(4 * weights, True, COMPILED_HEIGHTS[1:]), (3 * weights, False, COMPILED_HEIGHTS)]:
        monkeypatch.setattr(lookahead.hf, "available_memory", lambda: free)
        runner = HFModelRunner(llama_tiny, compile=True, packed_linear=False)
        assert (runner.freezes, runner.compiled_heights) == (freezes, heights)
    assert not HFModelRunner(llama_tiny, packed_linear=False).freezes


def test_a_compiled_runner_prices_steps_by_its_compiled_steps_own_times(llama_tiny, monkeypatch, costs):
    """Measured: the eager curve (10, 11, 13, 20 ms here) and, for a compiled runner, its compiled steps (4, 5,
    7, 14 ms): the budget prices compiled steps by the latter, at the heights they are padded to; an eager
    runner of the same model keeps the eager curve."""
    monkeypatch.setattr(costs, "_step_seconds", lambda runner, sizes, batch:
                        {"sizes": list(sizes), "seconds": [4.0, 5.0, 7.0, 14.0], "one_row": 10.0})
    runner = HFModelRunner(llama_tiny, compile=True)
    curve = costs.cost_curve(runner)
    assert curve.relative == pytest.approx([1.0, 1.25, 1.75, 3.5]) and curve.padded_to == list(runner.compiled_heights)
    assert curve(3) == curve(4) == pytest.approx(1.75)
    assert costs.cost_curve(HFModelRunner(llama_tiny)).relative == pytest.approx([1.0, 1.1, 1.3, 2.0])


def test_each_compile_mode_has_its_own_measured_curve(llama_tiny, monkeypatch, costs):
    """A step compiled with the C++ wrapper is faster than a default compiled one: its curve is measured and
    cached apart."""
    times = {"default": [4.0, 5.0, 7.0, 14.0], "cpp-wrapper": [2.0, 3.0, 5.0, 12.0]}
    monkeypatch.setattr(costs, "_step_seconds", lambda runner, sizes, batch:
                        {"sizes": list(sizes), "seconds": times[runner.compile_mode], "one_row": 10.0})
    assert costs.cost_curve(HFModelRunner(llama_tiny, compile=True)).relative == pytest.approx([1.0, 1.25, 1.75, 3.5])
    faster = costs.cost_curve(HFModelRunner(llama_tiny, compile="cpp-wrapper"))
    assert faster.relative == pytest.approx([1.0, 1.5, 2.5, 6.0])


@pytest.mark.skipif(lookahead.kernels.library() is None, reason="our kernel does not build or run here")
def test_compiled_steps_on_our_kernels_and_frozen_ones_have_their_own_curves(llama_tiny, monkeypatch, costs):
    """A curve measured while compiled steps froze their weights does not price steps that call our kernels."""
    times = iter([[4.0, 5.0, 7.0, 14.0], [2.0, 3.0, 5.0, 12.0]])
    monkeypatch.setattr(costs, "_step_seconds", lambda runner, sizes, batch:
                        {"sizes": list(sizes), "seconds": next(times), "one_row": 10.0})
    ours = HFModelRunner(llama_tiny, compile=True)
    frozen = HFModelRunner(llama_tiny, compile=True)
    frozen.compiled_kernel = False
    assert costs.cost_curve(frozen).relative == pytest.approx([1.0, 1.25, 1.75, 3.5])
    assert costs.cost_curve(ours).relative == pytest.approx([1.0, 1.5, 2.5, 6.0]) and ours.compiled_kernel


def test_a_stored_compiled_curve_is_measured_again_where_a_row_now_runs_much_faster(
        llama_tiny, monkeypatch, costs, tmp_path):
    """Like the eager curves, a compiled curve keeps the eager one-row step timed in its rounds and is measured
    again where a process finds that step much faster (12 ms now against 20 stored)."""
    runner = HFModelRunner(llama_tiny, compile=True, packed_linear=False)
    monkeypatch.setattr(costs, "timed_seconds", lambda run, device: 12.0)  # the one-row probe
    monkeypatch.setattr(costs, "_step_seconds", lambda runner, sizes, batch:
                        {"sizes": list(sizes), "seconds": [4.0, 5.0, 7.0, 14.0], "one_row": 11.0})
    path = tmp_path / "costs" / f"{costs._curve_key(runner)}-None-b1-compiled.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"sizes": [1, 2, 4, 8], "seconds": [10.0, 30.0, 30.0, 30.0], "one_row": 20.0}))
    assert costs.cost_curve(runner).relative == pytest.approx([1.0, 1.25, 1.75, 3.5])
    assert json.loads(path.read_text())["one_row"] == 11.0


@pytest.mark.slow  # compiles the steps of a tiny model
def test_the_compiled_curve_is_timed_through_the_compiled_forward(llama_tiny, monkeypatch, tmp_path):
    """The compiled steps are those decoding runs (each height's first call recorded as its compilation), the
    one-row probe eager, in the same rounds; the runner is compiled again afterwards."""
    import lookahead.costs as costs

    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    runner = HFModelRunner(llama_tiny, compile=True)
    measured = costs._step_seconds(runner, (1, 2, 4), 2)
    assert measured["sizes"] == [1, 2, 4] and all(t > 0 for t in measured["seconds"]) and measured["one_row"] > 0
    # (Frozen steps pad one row to two.)
    assert sorted(runner.compile_seconds) == [(h, True) for h in (1, 2, 4) if h in runner.compiled_heights]
    assert runner._compiled is not None


@pytest.mark.slow  # compiles the batch shapes of a tiny model
def test_the_batch_and_server_benchmarks_compile_our_engines(tiny_dir, tmp_path):
    result = run_cli("bench", "--model", tiny_dir, "--batch-size", "1,3", "--limit", "3", "--max-new-tokens", "8",
                     "--config", "0,3,2", "--compile", "--out", str(tmp_path / "batch"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "batch" / "results.json").read_text())
    assert report["environment"]["compiled engines"] is True
    assert [r["identical"] for r in report["runs"] if r["method"] == "lookahead"] == [True, True]
    served = run_cli("bench", "serve", "--model", tiny_dir, "--clients", "2", "--requests", "3",
                     "--max-new-tokens", "8", "--compile", "--out", str(tmp_path / "serve"))
    assert served.returncode == 0, served.stderr
    report = json.loads((tmp_path / "serve" / "results.json").read_text())
    assert report["environment"]["compiled"] is True
    assert [r["failed"] for r in report["runs"]] == [0, 0] and report["runs"][1]["identical"] == 6  # 2 rounds of 3
    refused = run_cli("bench", "serve", "--url", "http://127.0.0.1:9", "--compile")
    assert refused.returncode == 2 and "lookahead serve --compile" in refused.stderr


@pytest.mark.slow  # compiles a few graphs of a tiny model
def test_after_warming_up_an_engine_compiles_nothing_more_as_sequences_join_and_leave():
    """Every compiled step covers the first slots (the others padded) and takes the number of sequences,
    the height and the attended length as sizes: once `warm_up` has compiled its graphs, a run in which
    requests of different lengths join and leave, with and without lookahead, compiles no new one, and
    each output is transformers' greedy output."""
    from torch._dynamo.utils import counters

    model = make_tiny_model("llama")
    engine = Engine(model, max_batch=3, max_length=96, compile=True)
    engine.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the counter counts this process's compiled graphs (4 here in a fresh process)
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 8, 17, 6)]
    configs = [None, PLAIN_CONFIG, LookaheadConfig(window=2, ngram=3, guesses=2), None, PLAIN_CONFIG]
    budgets = [20, 7, 15, 9, 12]
    ids = {engine.add_request(p, RequestParams(n, c)): (p, n) for p, c, n in zip(prompts, configs, budgets)}
    outputs: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].extend(output.tokens)
    assert counters["stats"]["unique_graphs"] == graphs
    for request_id, (prompt, count) in ids.items():
        assert outputs[request_id] == reference_greedy(model, prompt.view(1, -1), count)[0, prompt.numel():].tolist()


@pytest.mark.skipif(lookahead.kernels.library() is None, reason="our kernel does not build or run here")
def test_runners_that_run_a_models_linears_differently_do_not_share_compiled_graphs(llama_tiny):
    """Compiled graphs keep no guards on the model's modules, so a graph traced through our kernels would run
    for a runner asked to use the model's own linears (`packed_linear=False`) if they shared one."""
    ours = HFModelRunner(llama_tiny, compile=True)
    own = HFModelRunner(llama_tiny, compile=True, packed_linear=False)
    assert ours.compiled_kernel and not own.compiled_kernel
    assert ours._compiled is not own._compiled
    assert HFModelRunner(llama_tiny, compile=True)._compiled is ours._compiled


def test_our_kernel_is_offered_only_where_it_builds(llama_tiny, monkeypatch, tmp_path):
    """A compiler that fails (or none): a warning that says so, no kernel, and no packer of ours; nothing is
    left behind as built."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # found on the PATH, fails every build
    lookahead.kernels.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"kernels did not build \(false failed: .*\); steps run on torch"):
            assert lookahead.kernels.library() is None
        assert "native" not in lookahead.hf.PackedLinears.packers(llama_tiny)
        assert not [path.name for path in (tmp_path / "kernels").iterdir() if not path.name.startswith(".")]
    finally:
        lookahead.kernels.library.cache_clear()


@pytest.mark.parametrize("cc, warning", [
    ("env false", r"kernels did not build \(env failed"),  # a command of several words (as `ccache cc`) is run
    ("no-such-compiler -m64", r"CC='no-such-compiler -m64' names no program found on the PATH"),
])
def test_a_compiler_named_in_cc_is_run_with_its_arguments_or_said_to_be_missing(monkeypatch, tmp_path, cc, warning):
    """CC and CXX may hold a command with arguments; one that names no program says so, never silently."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", cc)
    lookahead.kernels.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=warning):
            assert lookahead.kernels.library() is None
    finally:
        lookahead.kernels.library.cache_clear()


def test_a_cache_folder_that_cannot_be_written_means_no_kernel_and_a_warning(llama_tiny, monkeypatch, tmp_path):
    """Where the kernels cannot be built or kept, decoding runs without them rather than failing."""
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path / "not-a-folder"))
    lookahead.kernels.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="kernels not built, .* is not writable"):
            assert lookahead.kernels.library() is None
        assert "native" not in lookahead.hf.PackedLinears.packers(llama_tiny)
    finally:
        lookahead.kernels.library.cache_clear()


def test_an_install_without_the_kernel_sources_runs_without_them_and_says_so(llama_tiny, monkeypatch, tmp_path):
    """A wheel had left ops.cpp out (package-data named *.c alone): the first float32 step raised
    FileNotFoundError. Sources missing now mean no kernel, a warning naming them, and torch's linears."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(lookahead.kernels, "SOURCES", [*lookahead.kernels.KERNEL_SOURCES, tmp_path / "ops.cpp"])
    lookahead.kernels.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"sources are missing from .* \(ops.cpp\); steps run on torch"):
            assert lookahead.kernels.library() is None
        assert "native" not in lookahead.hf.PackedLinears.packers(llama_tiny)
    finally:
        lookahead.kernels.library.cache_clear()


def test_the_package_data_names_every_file_of_the_package_that_is_not_python():
    """A wheel carries the modules and what pyproject's package-data names: the kernels' C and C++ sources, the
    chat page and the bundled prompts must all be named there."""
    import tomllib

    package = Path(lookahead.kernels.__file__).parents[1]
    pyproject = tomllib.loads((package.parents[1] / "pyproject.toml").read_text())
    named = {path for pattern in pyproject["tool"]["setuptools"]["package-data"]["lookahead"]
             for path in package.glob(pattern) if path.is_file()}
    files = {path for path in package.rglob("*")
             if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}
    assert {"ops.cpp", "linear_f32.c", "chat.html"} <= {path.name for path in files}
    assert sorted(map(str, files - named)) == []


@pytest.mark.slow  # compiling takes seconds per step shape
def test_each_model_compiles_its_own_graphs_and_a_changed_model_compiles_again(llama_tiny):
    """Compiled steps keep no guards on the model's modules, so each model gets graphs of its own: a model of the
    same class with another MLP width and one with the same widths but other weights, decoded between two runs of
    the first, each decode as their own `generate`; a model whose weights changed dtype since gets a new function."""
    config = copy.deepcopy(llama_tiny.config)
    config.intermediate_size = 96
    narrower = type(llama_tiny)(config)
    twin = make_tiny_model("llama", seed=1)
    prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(8))
    for model in (llama_tiny, narrower, twin, llama_tiny):
        out = generate(model, prompt, max_new_tokens=10, config=PLAIN_CONFIG, compile=True)
        assert torch.equal(out.sequences, reference_greedy(model, prompt, 10))
    first = lookahead.hf._compiled_forward(twin, "default", "as-is")
    assert lookahead.hf._compiled_forward(twin, "default", "as-is") is first
    assert lookahead.hf._compiled_forward(twin, "default", "frozen") is not first
    assert lookahead.hf._compiled_forward(llama_tiny, "default", "as-is") is not first
    assert lookahead.hf._compiled_forward(twin.to(torch.bfloat16), "default", "as-is") is not first


@pytest.mark.slow  # 15-25 s: dynamo compiles the step shapes as they come
def test_a_model_whose_owner_compiled_its_forward_decodes_as_greedy_generate():
    """`model.forward = torch.compile(model.forward)`, as transformers documents it: the first forward, traced by
    dynamo, allocates the KV store's buffers, and marking them dynamic there was refused (a crash at the first
    step)."""
    model = make_tiny_model("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    expected = reference_greedy(model, prompt, 10, eos_token_id=[])
    model.forward = torch.compile(model.forward)
    out = generate(model, prompt, max_new_tokens=10, eos_token_id=[], config=LookaheadConfig(3, 3, 3),
                   packed_linear=False)
    assert torch.equal(out.sequences, expected)
