"""Sampled references (temperature > 0, z-lab's convention): the position-keyed Gumbel-max sampler
gives the same references whatever the batch size and padding, for a given seed; another seed (or
temperature) is another cache entry; greedy (T=0) keys and outputs are unchanged; the static-cache
engine (generator.Generator, run eagerly on CPU) samples exactly as the dynamic-cache path; options
are validated naming the key."""

import pytest
import torch
from conftest import loop_counters

from dflash.models.target.sampling import Sampling, pick, row_keys
from dflash.stages.references.collect import ReferenceOptions, get_references, greedy_generate
from dflash.util.errors import ConfigError

PROMPTS = [[5, 9, 11, 4], [7, 3], [12, 8, 6, 10, 9, 5, 4], [20, 21, 22]]
HOT = Sampling(temperature=1.0, top_p=0.95, top_k=50, seed=7)


def test_pick_is_a_function_of_logits_key_and_position():
    z = torch.randn(3, 100)
    keys, pos = row_keys([[1, 2], [3], [1, 2]], 7), torch.tensor([4, 4, 4])
    a = pick(z, HOT, keys, pos)
    assert a[0] == pick(z[:1], HOT, keys[:1], pos[:1])[0]  # one row alone = the same row in a batch
    assert torch.equal(pick(z, Sampling(), keys, pos), z.argmax(-1))  # T=0: argmax
    draws = {int(pick(z[:1], Sampling(1.0, seed=s), row_keys([[1, 2]], s), pos[:1])) for s in range(40)}
    assert len(draws) > 5  # the seed moves the sample


def test_sampled_references_reproducible_across_batch_sizes(qwen3_target):
    a = greedy_generate(qwen3_target, PROMPTS, 12, batch_size=4, sampling=HOT)
    b = greedy_generate(qwen3_target, PROMPTS, 12, batch_size=1, sampling=HOT)
    c = greedy_generate(qwen3_target, PROMPTS[::-1], 12, batch_size=3, sampling=HOT)[::-1]
    assert a == b == c
    assert a != greedy_generate(qwen3_target, PROMPTS, 12, batch_size=4)  # sampled, not greedy
    assert a != greedy_generate(qwen3_target, PROMPTS, 12, batch_size=4, sampling=Sampling(1.0, 0.95, 50, seed=8))


def test_static_engine_samples_like_the_dynamic_path(qwen3_target):
    from dflash.models.engine.decode import unsupported
    from dflash.models.engine.generator import Generator

    if unsupported(qwen3_target.config) is not None:
        pytest.skip("the static engine does not support this target")
    gen = Generator(qwen3_target, 4, max(map(len, PROMPTS)), 12, graphs=False, sampling=HOT)
    assert gen(PROMPTS) == greedy_generate(qwen3_target, PROMPTS, 12, batch_size=4, sampling=HOT)


def test_seed_and_temperature_are_in_the_cache_key(qwen3_target, tmp_path):
    tmpl = {}

    def run(**kw):
        return get_references(qwen3_target, PROMPTS[:2], 8, tmpl, tmp_path, options=ReferenceOptions(**kw))

    greedy, st = run()
    assert st.generated == 2
    s7, st = run(temperature=1.0, seed=7)
    assert st.generated == 2
    again, st = run(temperature=1.0, seed=7)
    assert again == s7 and st.hits == 2
    _, st = run(temperature=1.0, seed=8)
    assert st.generated == 2
    back, st = run()
    assert back == greedy and st.hits == 2  # greedy keys unchanged


@pytest.mark.parametrize(
    "key,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("seed", -1)]
)
def test_options_validated_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"references.{key}="):
        ReferenceOptions(**{key: value}).validate(8)


def test_replay_on_a_sampled_reference_equals_the_online_loop_under_zlabs_rule(qwen3_target, make_drafter):
    """T > 0: the online loop samples each verified slot with the same position-keyed sampler, accepts a
    greedy draft while it equals the sample, commits the sample at the first mismatch. Its output is the
    sampled reference, and the replay on that reference walks the same blocks, step by step."""
    from shortcuts import evaluate_sequence

    from dflash.models.target.forward import tapped_forward
    from dflash.online.speculative import speculative_generate

    drafter = make_drafter(qwen3_target, block_size=4).float()
    for x in PROMPTS[:2]:
        online = speculative_generate(qwen3_target, drafter, x, max_new_tokens=16, graphs=False, sampling=HOT)
        ref = greedy_generate(qwen3_target, [x], 16, 1, sampling=HOT)[0]
        assert online.tokens == ref
        taps = tapped_forward(qwen3_target, torch.tensor([x + ref]), drafter.cfg.target_layer_ids)[0]
        c, blocks = evaluate_sequence(drafter, qwen3_target, x, ref, taps)
        assert [(b.anchor_pos, b.accepted, b.proposal) for b in blocks] == [
            (b.anchor_pos, b.accepted, b.proposal) for b in online.blocks
        ]
        assert loop_counters(c) == loop_counters(
            online.counters
        )  # one step counter for both, committed_uncapped included
