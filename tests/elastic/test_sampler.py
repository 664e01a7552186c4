"""ElasticSampler's permutation: a new one each epoch (seed + epoch), and a restored state never reuses a
cached order (the two sampler mutants issue 21 found surviving)."""
import json

import numpy as np
import pytest

from elasticlab.elastic.sampler import ElasticSampler


def test_each_epoch_has_its_own_permutation_seeded_by_seed_plus_epoch():
    s = ElasticSampler(50, seed=7)
    orders = [s.permutation(e).copy() for e in range(3)]
    for e, order in enumerate(orders):
        np.testing.assert_array_equal(order, np.random.default_rng(7 + e).permutation(50))
        assert sorted(order.tolist()) == list(range(50))
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    # consuming a whole epoch in steps gives its order, then the next epoch's order, not a replay
    got = []
    for _ in range(5):
        got.append(s.step_indices(10).copy())
        s.advance(10)
    np.testing.assert_array_equal(np.concatenate(got), orders[0])
    assert s.epoch == 1
    np.testing.assert_array_equal(s.step_indices(50), orders[1])


def test_load_state_dict_drops_the_cached_permutation():
    s = ElasticSampler(40, seed=0)
    before = s.step_indices(40).copy()                     # caches epoch 0's order under seed 0
    s.load_state_dict({"epoch": 0, "position": 0, "seed": 5, "num_samples": 40, "shuffle": True})
    after = s.step_indices(40)
    np.testing.assert_array_equal(after, np.random.default_rng(5).permutation(40))
    assert not np.array_equal(before, after)
    s.load_state_dict({"epoch": 0, "position": 0, "seed": 5, "num_samples": 40, "shuffle": False})
    np.testing.assert_array_equal(s.step_indices(40), np.arange(40))


def test_fresh_sampler_serves_any_epoch_first_and_counts_what_remains():
    s = ElasticSampler(30, seed=3)
    np.testing.assert_array_equal(s.permutation(1), np.random.default_rng(4).permutation(30))
    assert s.remaining == 30
    s.advance(12)
    assert (s.remaining, s.position) == (18, 12)
    s.advance(100)                                         # the rest of the epoch, then the next one
    assert (s.epoch, s.position, s.remaining) == (1, 0, 30)


def test_restored_later_epoch_does_not_reuse_a_cached_order():
    s = ElasticSampler(20, seed=0)
    s.permutation(1)                                        # caches epoch 1's order under seed 0
    s.load_state_dict({"epoch": 1, "position": 4, "seed": 9, "num_samples": 20, "shuffle": True})
    np.testing.assert_array_equal(s.step_indices(3), np.random.default_rng(10).permutation(20)[4:7])


def test_effective_rows_keep_the_latest_generation_whatever_the_order():
    from elasticlab.elastic.sampler import effective_rows
    rows = [{"step": 5, "generation": 2, "rank": 0}, {"step": 5, "generation": 1, "rank": 0},
            {"step": 6, "rank": 0}]
    kept = effective_rows(rows)
    assert [r.get("generation") for r in kept] == [2, None]


def test_check_exactly_once_reports_world_sizes_and_completeness():
    from elasticlab.elastic.sampler import check_exactly_once
    rows = [{"step": 0, "rank": 0, "epoch": 0, "world_size": 2, "indices": [0, 1]},
            {"step": 0, "rank": 1, "epoch": 0, "world_size": 2, "indices": [2]},
            {"step": 1, "rank": 0, "epoch": 0, "world_size": 1, "indices": [3]},
            {"step": 2, "rank": 0, "epoch": 1, "world_size": 3, "indices": [0, 2]}]
    rep = check_exactly_once(rows, 4)
    assert rep["world_sizes"] == [2, 1, 3]
    assert rep["epochs"][0] == {"missing": [], "duplicates": [], "complete": True}
    assert rep["epochs"][1]["missing"] == [1, 3] and rep["epochs"][1]["complete"] is False
    assert rep["ok"] is True                                # an unfinished last epoch is not an error
    rows[2]["indices"] = [1]                                # epoch 0 now misses 3 and repeats 1
    rep = check_exactly_once(rows, 4)
    assert rep["epochs"][0]["missing"] == [3] and rep["epochs"][0]["duplicates"] == [1]
    assert rep["epochs"][0]["complete"] is True and rep["ok"] is False


def test_recorded_through_is_the_newest_generations_last_step_with_every_ranks_rows():
    from elasticlab.elastic.sampler import recorded_through

    def row(step, rank, gen, world=2):
        return {"epoch": 0, "step": step, "rank": rank, "world_size": world, "indices": [], "generation": gen}

    assert recorded_through([]) is None
    assert recorded_through([{"epoch": 0, "step": 1, "rank": 0, "world_size": 1, "indices": []}]) is None
    old = [row(s, r, 1) for s in range(1, 9) for r in (0, 1)]
    assert recorded_through(old) == 8
    assert recorded_through(old + [row(9, 0, 1)]) == 8              # rank 1's rows of step 9 never came
    # the newest generation counts (it resumed at 4 and re-ran 5..6); world 3, rank 2 wrote nothing yet
    new = [row(s, r, 7, world=3) for s in (5, 6) for r in (0, 1)]
    assert recorded_through(old + new) == 4
    assert recorded_through(old + new + [row(5, 2, 7, world=3)]) == 5


def test_a_finished_jobs_last_epoch_must_be_complete_when_its_epochs_are_given():
    """Without ``epochs`` a short last epoch is taken for a job stopped inside it (``ok``); a job that ran
    its epochs to the end and whose record misses samples of the last one is not ``ok`` (the local job's
    record-window failure left 8 of 256 out and ``ok`` was True)."""
    from elasticlab.elastic.sampler import check_exactly_once

    def rows(epoch, idx):
        return [{"epoch": epoch, "step": 10 * epoch + k, "rank": 0, "world_size": 1, "indices": list(c)}
                for k, c in enumerate(np.array_split(idx, 4))]

    whole = rows(0, np.arange(20)) + rows(1, np.arange(20))
    short = rows(0, np.arange(20)) + rows(1, np.arange(12))
    assert check_exactly_once(whole, 20)["ok"] and check_exactly_once(whole, 20, epochs=2)["ok"]
    assert check_exactly_once(short, 20)["ok"]                       # stopped inside epoch 1
    rep = check_exactly_once(short, 20, epochs=2)
    assert not rep["ok"] and rep["epochs"][1]["missing"] == list(range(12, 20))
    rep = check_exactly_once(rows(0, np.arange(20)), 20, epochs=2)  # epoch 1 never recorded
    assert not rep["ok"] and rep["epochs"][1]["missing"] == list(range(20))
    dup = rows(0, np.arange(20)) + rows(0, np.arange(3))
    assert not check_exactly_once(dup, 20)["ok"]


def test_read_record_passes_over_a_torn_last_line_and_names_a_bad_one(tmp_path):
    """One reader for every check of a sample record: a last line cut short (a writer died in it) is left
    out; a bad line before it is an error naming the file and line, or left out when ``lenient``."""
    from elasticlab.elastic.sampler import read_record
    rows = [{"epoch": 0, "step": s, "rank": 0, "world_size": 1, "indices": [s], "generation": 0}
            for s in (1, 2)]
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    p = tmp_path / "samples.jsonl"
    p.write_text(whole + "\n" + '{"epoch": 0, "st')              # a blank line, then a torn one
    assert read_record(p) == rows
    p.write_text(whole + "{oops}\n" + whole)
    with pytest.raises(ValueError, match=r"samples.jsonl', line 3: not a JSON row"):
        read_record(p)
    assert read_record(p, lenient=True) == rows + rows
    p.write_text(whole + '{"epoch": 0, "st\n')                  # bad, though a newline ends it: not torn
    with pytest.raises(ValueError, match="line 3"):
        read_record(p)
    with pytest.raises(FileNotFoundError):
        read_record(tmp_path / "none.jsonl")
    assert read_record(tmp_path / "none.jsonl", missing_ok=True) == []
