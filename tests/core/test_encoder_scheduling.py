"""Images of vision-language prompts in the scheduler: when each is encoded, the per-step
encoder budget, the encoder cache's ledger (refs, idle entries, eviction, what the workers
are told to drop) and image hashes in block hashes. Pure Python, no model.

Every step goes through ``Workers``: the simulated workers of sim.py (tokens, blocks, KV
contents, rebuilt from the diffs alone) plus an encoder side that keeps what
worker/model_runner.py keeps (each request's images, the embeddings held under their hashes),
also from the diffs alone. After every step it checks that each image placeholder a step
computes finds its embeddings held, that nothing is encoded twice or over the budget, and
that the scheduler's ledger equals what the workers hold.
"""

from __future__ import annotations

import random

import pytest

from aiolm.core.request import Request, RequestStatus
from aiolm.core.scheduler import Scheduler
from aiolm.core.step import ModelRunnerOutput, SchedulerOutput
from aiolm.multimodal.inputs import ImageInput
from aiolm.params import ParamError, SamplingParams

from .sim import EOS, WorkerSim, check_scheduler, make_scheduler


def image(h: str, offset: int, length: int) -> ImageInput:
    return ImageInput(h, offset, length, b"", [3, 1, 1])  # the scheduler never reads the pixels


def vlm_request(
    req_id: str, prompt: int | list[int], images: list[ImageInput], max_tokens: int = 4, base: int = 1, **kw
) -> Request:
    """A request whose prompt is ``prompt`` or, for an int, that many tokens from ``base``."""
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    sp = SamplingParams(max_tokens=max_tokens, eos_token_ids=(EOS,))
    return Request(req_id, tokens, sp, mm_inputs=images, **kw)


class Workers:
    """Drives ``schedule -> workers -> update_from_output`` and checks every step (see the
    module docstring). ``check_scheduler`` runs without the step's output: its work-conservation
    rule does not know that a running request may wait for encoder budget or cache room."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = WorkerSim(block_size=sched.config.block_size)
        self.images_of: dict[str, list[ImageInput]] = {}
        self.cache: dict[str, int] = {}  # image hash -> embeddings held
        self.history: list[SchedulerOutput] = []

    def step(self, token: int = 7) -> SchedulerOutput:
        sched = self.sched
        so = sched.schedule()
        self.history.append(so)
        check_scheduler(sched)
        sampling = self.kv.apply(so)
        self.kv.check(sched, so)
        self._encode(so)
        check_ledger(sched)
        runner_output = ModelRunnerOutput(req_ids=sampling, sampled_token_ids=[[token] for _ in sampling])
        sched.update_from_output(so, runner_output)
        check_scheduler(sched)
        check_ledger(sched)
        return so

    def steps(self, n: int) -> list[SchedulerOutput]:
        return [self.step() for _ in range(n)]

    def drain(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {sorted(self.sched.requests)}")

    def _encode(self, so: SchedulerOutput) -> None:
        """The encoder's part of a step, as the model runner does it: forget finished requests,
        learn new ones' images, drop the freed entries, encode, then read each placeholder."""
        sched = self.sched
        for rid in so.finished_req_ids:
            self.images_of.pop(rid, None)
        new_ids = {new.req_id for new in so.scheduled_new_reqs}
        for new in so.scheduled_new_reqs:
            if new.mm_inputs:
                self.images_of[new.req_id] = list(new.mm_inputs)
        for h in so.free_encoder_hashes:
            assert h in self.cache, f"told to drop {h}, which the workers do not hold"
            del self.cache[h]
        encoder_tokens = 0
        for rid, indices in so.encoder_inputs.items():
            assert rid in so.num_scheduled_tokens, f"{rid}'s images are encoded in a step that does not run it"
            assert rid in self.images_of, f"{rid}'s images are encoded but the workers do not know its images"
            for i in indices:
                im = self.images_of[rid][i]
                assert im.hash not in self.cache, f"{im.hash} encoded while held"
                self.cache[im.hash] = im.length
                encoder_tokens += im.length
        assert encoder_tokens <= sched.encoder_budget, f"{encoder_tokens} embeddings encoded in one step"
        held = sum(self.cache.values())
        assert held <= sched.encoder_cache.capacity, f"the workers hold {held} embeddings, over the cache's size"
        assert self.cache == sched.encoder_cache.size
        starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        starts.update(zip(c.req_ids, c.num_computed_tokens))
        for rid, n in so.num_scheduled_tokens.items():
            start = starts[rid]
            for im in self.images_of.get(rid, ()):
                if im.overlaps(start, start + n):
                    assert im.hash in self.cache, f"{rid} computes placeholders of {im.hash} without its embeddings"
                    if sched.config.whole_images:
                        # All of them in this step, but those a prefix hit already holds.
                        assert im.offset + im.length <= start + n, f"{rid} splits {im.hash} across steps"
                        assert im.offset >= start or rid in new_ids, f"{rid} splits {im.hash} across steps"

    def encoded(self) -> list[dict[str, list[int]]]:
        return [so.encoder_inputs for so in self.history]

    def freed(self) -> list[str]:
        return [h for so in self.history for h in so.free_encoder_hashes]


def check_ledger(sched: Scheduler) -> None:
    """The ledger's own bookkeeping: sizes add up, an entry is idle exactly when nobody
    references it, and only live requests reference entries."""
    ledger = sched.encoder_cache
    assert ledger.used == sum(ledger.size.values()) <= ledger.capacity
    assert set(ledger.idle) <= set(ledger.size)
    for h in ledger.size:
        users = ledger.refs.get(h, set())
        assert (h in ledger.idle) == (not users), f"{h}: idle {h in ledger.idle}, users {users}"
        assert users <= set(sched.requests), f"{h} is referenced by finished requests {users - set(sched.requests)}"


# -- when an image is encoded -------------------------------------------------------


def test_a_whole_prompt_encodes_its_image_once_in_its_first_step():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=64)
    im = image("a", 10, 16)
    sched.add_request(vlm_request("r", 40, [im], max_tokens=3))
    w = Workers(sched)
    so = w.step()
    assert so.num_scheduled_tokens == {"r": 40}
    assert so.encoder_inputs == {"r": [0]}
    assert so.scheduled_new_reqs[0].mm_inputs == [im]
    assert sched.encoder_cache.encoded == 1
    for so in w.steps(2):
        assert so.num_scheduled_tokens == {"r": 1} and so.encoder_inputs == {}
    assert not sched.has_unfinished_requests()
    assert sched.encoder_cache.encoded == 1


def test_a_chunked_prompt_encodes_the_image_in_the_chunk_that_first_reaches_it():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_encoder_input_tokens=16)
    sched.add_request(vlm_request("r", 40, [image("a", 10, 16)], max_tokens=1))  # placeholders 10..25
    w = Workers(sched)
    for step in range(5):
        so = w.step()
        assert so.num_scheduled_tokens == {"r": 8}
        assert so.encoder_inputs == ({"r": [0]} if step == 1 else {}), step
        # The entry is the request's until its last placeholder is computed (position 25, step 3).
        assert sched.encoder_cache.refs.get("a", set()) == ({"r"} if step in (1, 2) else set()), step
    assert not sched.has_unfinished_requests()
    assert sched.encoder_cache.encoded == 1


@pytest.mark.parametrize("offset", [4, 0])
def test_the_encoder_budget_cuts_the_next_prompt_just_before_its_image(offset):
    """Two 16-token images, a budget of 16: one is encoded per step. The second prompt runs
    its text before the image, if any, and the rest (image first) in the next step."""
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=16)
    sched.add_request(vlm_request("a", 24, [image("a", 4, 16)]))
    sched.add_request(vlm_request("b", 24, [image("b", offset, 16)], base=101))
    w = Workers(sched)
    so = w.step()
    assert so.encoder_inputs == {"a": [0]}
    assert so.num_scheduled_tokens == ({"a": 24, "b": 4} if offset else {"a": 24})
    if not offset:
        assert [r.req_id for r in sched.waiting] == ["b"]
    so = w.step()
    assert so.encoder_inputs == {"b": [0]}
    assert so.num_scheduled_tokens == {"a": 1, "b": 24 - offset}
    w.drain()
    assert sched.encoder_cache.encoded == 2


# -- the encoder cache -----------------------------------------------------------------


def test_a_held_image_is_reused_and_the_least_recently_released_is_evicted_when_full():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=16, encoder_cache_size=32)
    ledger = sched.encoder_cache
    w = Workers(sched)

    def run(rid: str, h: str, base: int) -> list[dict[str, list[int]]]:
        # A different first token each time: no prefix-cache hit covers the image.
        sched.add_request(vlm_request(rid, 24, [image(h, 4, 16)], max_tokens=1, base=base))
        start = len(w.history)
        w.drain()
        return w.encoded()[start:]

    assert run("r1", "x", 100) == [{"r1": [0]}]
    assert list(ledger.idle) == ["x"] and ledger.used == 16  # held for reuse after r1 finished
    assert run("r2", "x", 200) == [{}]
    assert run("r3", "x", 300) == [{}]
    assert ledger.encoded == 1
    assert run("r4", "y", 400) == [{"r4": [0]}]  # room left: nothing is evicted
    assert w.freed() == [] and ledger.used == 32
    assert run("r5", "x", 500) == [{}]  # x is released after y now
    assert list(ledger.idle) == ["y", "x"]
    assert run("r6", "z", 600) == [{"r6": [0]}]  # full: the least recently released goes
    assert w.history[-1].free_encoder_hashes == ["y"]  # in the output of the step that encodes z
    assert set(ledger.size) == {"x", "z"}
    assert run("r7", "x", 700) == [{}]
    assert w.freed() == ["y"]  # told once
    assert ledger.encoded == 3


def test_a_referenced_image_is_never_evicted_a_new_image_waits_for_room():
    """a and b hold the whole cache with images they are still computing: c's image waits,
    and c with it, until one of them has computed its placeholders and let its image go."""
    sched = make_scheduler(
        max_num_batched_tokens=64,
        long_prefill_token_threshold=8,
        max_num_encoder_input_tokens=32,
        encoder_cache_size=32,
    )
    ledger = sched.encoder_cache
    for i, rid in enumerate("abc"):
        sched.add_request(vlm_request(rid, 40, [image(rid, 4, 16)], base=100 * (i + 1)))  # placeholders 4..19
    w = Workers(sched)
    so = w.step()
    assert so.encoder_inputs == {"a": [0], "b": [0]}
    assert so.num_scheduled_tokens == {"a": 8, "b": 8, "c": 4}  # no budget left for c's image: its text runs
    so = w.step()
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}  # c has budget but no room: it waits
    assert so.encoder_inputs == {} and ledger.refs == {"a": {"a"}, "b": {"b"}}
    while "c" not in w.history[-1].encoder_inputs:
        assert not w.history[-1].free_encoder_hashes
        w.step()
        assert len(w.history) < 10
    so = w.history[-1]
    assert sched.requests["a"].num_computed_tokens >= 20 and sched.requests["b"].num_computed_tokens >= 20
    assert so.free_encoder_hashes == ["a"]  # idle once a passed it, and released before b's
    w.drain()
    assert ledger.encoded == 3 and w.freed() == ["a"]


# -- release ---------------------------------------------------------------------------


def test_an_image_goes_idle_once_its_placeholders_are_computed_while_the_request_decodes():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(vlm_request("r", 40, [image("a", 10, 16), image("b", 30, 8)], max_tokens=5))
    w = Workers(sched)
    w.step()
    r = sched.requests["r"]
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 40
    ledger = sched.encoder_cache
    assert list(ledger.idle) == ["a", "b"] and not ledger.refs["a"] and not ledger.refs["b"]
    w.step()
    assert list(ledger.idle) == ["a", "b"]  # a decode step takes no reference again
    w.drain()
    assert ledger.encoded == 2 and list(ledger.idle) == ["a", "b"]


def test_abort_releases_an_image_the_request_is_halfway_through():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_encoder_input_tokens=16)
    sched.add_request(vlm_request("r", 40, [image("a", 4, 16)]))
    w = Workers(sched)
    w.step()
    assert sched.encoder_cache.refs["a"] == {"r"} and not sched.encoder_cache.idle
    sched.abort_requests(["r"])
    check_ledger(sched)
    assert list(sched.encoder_cache.idle) == ["a"] and sched.encoder_cache.holds("a")


def test_preemption_releases_the_image_and_the_resumed_request_reads_it_again():
    # 8 usable blocks of 4 tokens. h is admitted first; when its decode needs a block, r (the
    # latest, halfway through its image) is preempted.
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sched.add_request(vlm_request("h", 8, [], max_tokens=8, base=100))
    sched.add_request(vlm_request("r", 28, [image("l", 8, 16)], max_tokens=2))  # placeholders 8..23
    ledger = sched.encoder_cache
    w = Workers(sched)
    w.steps(2)
    assert w.encoded() == [{}, {"r": [0]}]
    assert ledger.refs["l"] == {"r"}
    so = w.step()
    r = sched.requests["r"]
    assert r.status == RequestStatus.PREEMPTED and "r" in so.finished_req_ids
    assert ledger.refs["l"] == set() and list(ledger.idle) == ["l"]
    w.drain()
    resumed = [nr for so in w.history[3:] for nr in so.scheduled_new_reqs if nr.req_id == "r"]
    assert len(resumed) == 1 and resumed[0].num_computed_tokens < 24  # its prefix hit ends before the image does
    assert ledger.encoded == 1  # the entry stayed: the resumed prompt read it without encoding
    assert sched.num_preemptions == 1


def test_reset_workers_clears_the_ledger_and_keeps_the_counter():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_encoder_input_tokens=16, encoder_cache_size=32)
    sched.add_request(vlm_request("done", 12, [image("x", 0, 8)], max_tokens=1, base=100))
    sched.add_request(vlm_request("r", 40, [image("a", 10, 16)]))
    w = Workers(sched)
    w.steps(4)
    ledger = sched.encoder_cache
    assert ledger.refs["a"] == {"r"} and list(ledger.idle) == ["x"] and ledger.encoded == 2
    sched.reset_workers(64)
    assert (ledger.size, ledger.refs, dict(ledger.idle), ledger.used) == ({}, {}, {}, 0)
    assert ledger.encoded == 2
    w = Workers(sched)  # the new workers hold nothing
    w.drain()
    assert w.encoded()[1] == {"r": [0]}  # the recomputed prompt encodes its image again
    assert w.freed() == [] and ledger.encoded == 3


# -- intake ----------------------------------------------------------------------------


@pytest.mark.parametrize(("budget", "cache_size"), [(16, 64), (64, 16), (0, 0)])
def test_an_image_longer_than_the_encoder_budget_or_the_cache_is_refused(budget, cache_size):
    # (0, 0): the budget is max_num_batched_tokens (16), the cache as large.
    sched = make_scheduler(
        max_num_batched_tokens=16, max_num_encoder_input_tokens=budget, encoder_cache_size=cache_size
    )
    with pytest.raises(ParamError) as e:
        sched.add_request(vlm_request("long", 40, [image("a", 0, 8), image("b", 10, 17)]))
    assert e.value.param == "messages" and "17" in str(e.value)
    assert sched.get_num_unfinished_requests() == 0
    sched.add_request(vlm_request("ok", 40, [image("a", 0, 8), image("b", 10, 16)]))
    assert sched.get_num_unfinished_requests() == 1


@pytest.mark.parametrize("whole_images", [False, True])
def test_whole_images_refuse_an_image_longer_than_a_step(whole_images):
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=8, whole_images=whole_images)
    long = vlm_request("long", 40, [image("a", 10, 9)])
    if whole_images:
        with pytest.raises(ParamError) as e:
            sched.add_request(long)
        assert e.value.param == "messages" and "--long-prefill-token-threshold" in str(e.value)
    else:
        sched.add_request(long)  # split across chunks
    sched.add_request(vlm_request("ok", 40, [image("a", 10, 8)]))


def test_whole_images_cut_the_chunk_before_an_image_that_would_be_split():
    sched = make_scheduler(max_num_batched_tokens=16, whole_images=True)
    sched.add_request(vlm_request("r", 40, [image("a", 10, 16)], max_tokens=1))  # placeholders 10..25
    w = Workers(sched)
    w.drain()
    assert [so.num_scheduled_tokens["r"] for so in w.history] == [10, 16, 14]
    assert w.encoded() == [{}, {"r": [0]}, {}]


# -- prefix caching --------------------------------------------------------------------


def test_block_hashes_differ_from_the_first_block_that_holds_an_image():
    sched = make_scheduler(max_num_batched_tokens=64)  # blocks of 4; the images fill 10..17
    a1 = vlm_request("a1", 24, [image("a", 10, 8)], max_tokens=1)
    a2 = vlm_request("a2", 24, [image("a", 10, 8)], max_tokens=1)
    b = vlm_request("b", 24, [image("b", 10, 8)], max_tokens=1)
    text = vlm_request("text", 24, [], max_tokens=1)
    for r in (a1, a2, b, text):
        sched.kv_cache_manager.attach(r)
        assert len(r.block_hashes) == 6
    assert a1.block_hashes == a2.block_hashes
    for other in (b, text):
        assert other.block_hashes[:2] == a1.block_hashes[:2]
        assert all(x != y for x, y in zip(other.block_hashes[2:], a1.block_hashes[2:]))

    # In the pool: b shares only the two blocks before the image; a2 shares every full block
    # but the last (one token is always computed), images included, so it needs no encoding.
    w = Workers(sched)
    for r in (a1, b, a2):
        sched.add_request(r)
        start = len(w.history)
        w.drain()
        assert w.history[start].scheduled_new_reqs[0].num_computed_tokens == {"a1": 0, "b": 8, "a2": 20}[r.req_id]
    assert w.encoded() == [{"a1": [0]}, {"b": [0]}, {}]


# -- random programs ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("whole_images", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_programs_keep_the_workers_and_the_ledger_agreed(seed, whole_images, policy):
    """Random budgets, cache sizes, pool sizes and prompts with one or two images each, drawn
    from a few hashes so reuse, eviction, preemption (of requests scheduled earlier in the
    same step, under the priority policy) and prefix hits all happen; ``Workers`` checks
    every step, and every request finishes."""
    rng = random.Random(seed)
    budget = rng.choice([8, 16, 24])
    step = rng.choice([8, 16, 32])
    threshold = rng.choice([0, 4, 8])
    sched = make_scheduler(
        policy=policy,
        num_blocks=rng.randint(14, 30),
        max_num_batched_tokens=step,
        long_prefill_token_threshold=threshold,
        max_num_encoder_input_tokens=budget,
        encoder_cache_size=rng.choice([budget, 2 * budget]),
        max_num_seqs=rng.randint(1, 4),
        whole_images=whole_images,
    )
    w = Workers(sched)
    longest = min(budget, threshold or step, step) if whole_images else budget  # else refused (tested above)
    lengths = {h: rng.randint(1, longest) for h in "pqrs"}  # the same pixels give as many embeddings
    for i in range(12):
        hashes = rng.sample("pqrs", rng.choice([1, 2]))
        total = sum(lengths[h] for h in hashes)
        n = rng.randint(total + 1, max(total + 1, 44))
        images, at, free = [], 0, n - total  # text before, between and after the images
        for h in hashes:
            gap = rng.randint(0, free)
            free -= gap
            images.append(image(h, at + gap, lengths[h]))
            at += gap + lengths[h]
        prefix = rng.choice([0, 1]) * 50  # two text families: prefix hits with and without the images
        tokens = list(range(prefix + 1, prefix + n + 1))
        sched.add_request(vlm_request(f"r{i}", tokens, images, max_tokens=3, priority=rng.randint(0, 2)))
        for _ in range(rng.randint(0, 3)):
            w.step()
    w.drain()
    check_ledger(sched)
    assert not any(sched.encoder_cache.refs.values())
    assert set(sched.encoder_cache.idle) == set(sched.encoder_cache.size)


# -- faults found with these tests -------------------------------------------------------
# Each fails until its fault is fixed; its docstring says what the code did when written.


def test_an_image_held_further_along_the_prompt_does_not_block_the_one_before_it():
    """FAILS: ``_hold_images`` references every held image of a prompt that is not computed
    yet, including those past the step's chunk. Here the cache (16) holds y, idle, and r's
    prompt has x (not held) then y: r's first chunk (text only) takes a reference on y, so
    x never finds room (``can_add`` counts only idle entries as freeable) and r never runs
    again: schedule() returns empty steps forever."""
    sched = make_scheduler(max_num_batched_tokens=8, max_num_encoder_input_tokens=16, encoder_cache_size=16)
    sched.add_request(vlm_request("warm", 20, [image("y", 2, 16)], max_tokens=1, base=100))
    w = Workers(sched)
    w.drain()
    assert list(sched.encoder_cache.idle) == ["y"]
    sched.add_request(vlm_request("r", 60, [image("x", 8, 16), image("y", 30, 16)], max_tokens=1))
    w.drain(max_steps=30)


def test_a_waiting_request_that_cannot_be_admitted_does_not_block_a_running_one():
    """FAILS: ``_fit_images`` references the held images a waiting prompt's chunk covers
    before its blocks are allocated, and when the allocation fails the reference stays. Here
    w's chunk covers x (held) but w needs 10 blocks while r holds 8 of the 16; r's next chunk
    needs y, which fits only if x goes, and x is w's now. Neither ever runs again, with one
    image a prompt and nothing else in the engine."""
    sched = make_scheduler(
        num_blocks=17, max_num_batched_tokens=128, max_num_encoder_input_tokens=16, encoder_cache_size=24
    )
    w = Workers(sched)
    sched.add_request(vlm_request("warm", 20, [image("x", 0, 16)], max_tokens=1, base=500))
    w.drain()  # x idle
    sched.add_request(vlm_request("e", 12, [image("z", 0, 8)], max_tokens=1, base=300))  # takes 8 of the budget
    sched.add_request(vlm_request("r", 48, [image("y", 32, 16)], max_tokens=1))  # cut before y: runs 0..31
    sched.add_request(vlm_request("w", 40, [image("x", 0, 16)], max_tokens=1, base=200))
    so = w.step()
    assert so.num_scheduled_tokens == {"e": 12, "r": 32} and [r.req_id for r in sched.waiting] == ["w"]
    w.drain(max_steps=30)


def test_the_images_of_one_chunk_never_overfill_the_cache():
    """FAILS: ``_fit_images`` checks room for a new image counting the idle entries as
    freeable, then references a held idle entry later in the same chunk, which takes it out
    of the idle ones; ``add`` then has nothing to evict and goes past the capacity. Here b (8)
    is idle in a cache of 16 and r's one chunk holds a (12, new) then b: the ledger (and the
    workers) hold 20."""
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=16, encoder_cache_size=16)
    w = Workers(sched)
    sched.add_request(vlm_request("warm", 12, [image("b", 0, 8)], max_tokens=1, base=500))
    w.drain()
    assert list(sched.encoder_cache.idle) == ["b"]
    sched.add_request(vlm_request("r", 24, [image("a", 0, 12), image("b", 12, 8)], max_tokens=1))
    w.drain()


def test_a_victim_preempted_after_it_was_scheduled_has_no_images_encoded():
    """FAILS: under the priority policy the victim may be a request scheduled earlier in the
    same step. Its tokens and blocks are taken back, but the images ``_encode_images`` put in
    this step's list stay: ``encoder_inputs`` names a request the same output lists in
    ``finished_req_ids`` and does not schedule. The model runner drops the request's images
    first (``_track_images``) and then fails on ``images_of[rid]`` in ``_run_encoder``; the
    encoder budget the victim took is not given back either."""
    sched = make_scheduler(policy="priority", num_blocks=9, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sched.add_request(vlm_request("low", 28, [image("l", 16, 8)], priority=1))  # placeholders 16..23
    w = Workers(sched)
    w.step()
    sched.add_request(vlm_request("high", 8, [], max_tokens=20, base=100, priority=0))
    w.step()  # low holds 4 blocks, high 2 of the 8
    # low's next chunk reaches its image; high's decode then needs a block and low is the victim.
    so = w.step()
    assert "low" in so.finished_req_ids and "low" not in so.num_scheduled_tokens
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    w.drain()
