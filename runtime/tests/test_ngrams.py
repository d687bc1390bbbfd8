"""The static n-gram table: counting, proposing, its file, and decoding with it (lossless)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import chisquare

from kibidango.bundle import BundleError
from kibidango.decode.distributions import Sampler
from kibidango.decode.ngrams import NgramTable
from kibidango.decode.speculative import DecodeConfig, Decoder, Metrics
from tests.conftest import PROMPTS, STORIES, needs_stories


def test_each_context_keeps_its_most_frequent_follower_and_counts():
    table = NgramTable.build([[1, 5, 9, 7], [1, 5, 9, 7], [2, 5, 9, 8]], vocab_size=16, n_max=3)
    assert table.entries[(5, 9)] == (7, 2, 3)  # 7 twice, 8 once
    assert table.entries[(2, 5, 9)] == (8, 1, 1) and table.entries[(9,)] == (7, 2, 3)
    assert (1, 5, 9, 7) not in table.entries  # contexts are at most n_max tokens
    with pytest.raises(ValueError, match="token id 16 is outside the vocabulary of 16"):
        NgramTable.build([[1, 16]], vocab_size=16)


def test_proposals_follow_the_longest_known_context_while_it_is_sure():
    seqs = [[3, 4, 5, 6, 7]] * 3 + [[9, 4, 5, 1]] * 2
    table = NgramTable.build(seqs, vocab_size=16, n_max=3)
    assert table.propose([3, 4, 5], 8) == [6, 7]  # (3, 4, 5) -> 6, then (4, 5, 6) -> 7, then nothing
    assert table.propose([9, 4, 5], 8) == [1]  # the longest context decides: (9, 4, 5) -> 1 (twice)
    assert table.propose([0, 4, 5], 8) == [6, 7]  # (0, 4, 5) unseen: (4, 5) -> 6 in 3 of 5
    assert table.propose([3, 4, 5], 1) == [6]
    assert table.propose([0, 0, 5], 8) == []  # only the one-token context (5,) is known: below ngram_min
    assert table.propose([0, 0, 5], 8, ngram_min=1) == [6, 7]
    assert table.propose([0, 4, 5], 8, min_share=0.7) == []  # (4, 5) -> 6 in 60% of its occurrences
    once = NgramTable.build([[3, 4, 5, 6]], vocab_size=16, n_max=3)
    assert once.propose([3, 4, 5], 8) == [] and once.propose([3, 4, 5], 8, min_count=1) == [6]


def test_the_file_round_trips_and_a_bad_one_is_refused_by_name(tmp_path):
    table = NgramTable.build([[1, 2, 3, 4, 2, 3, 5], [7, 2, 3, 4]], vocab_size=8, n_max=3)
    path = table.save(tmp_path / "ngrams.npz")
    back = NgramTable.load(path, vocab_size=8)
    assert back.entries == table.entries and back.n_max == 3 and back.vocab_size == 8

    with pytest.raises(BundleError, match="counted over a vocabulary of 8; the model has 512"):
        NgramTable.load(path, vocab_size=512)
    good = dict(np.load(path))

    def broken(name, **arrays):
        bad = tmp_path / name
        with open(bad, "wb") as f:
            np.savez(f, **{**good, **arrays})
        return bad

    with pytest.raises(BundleError, match=r"outside the vocabulary of 8"):
        NgramTable.load(broken("ids.npz", next=good["next"] + 8))
    with pytest.raises(BundleError, match="a count is below 1 or above"):
        NgramTable.load(broken("counts.npz", count=good["total"] + 1))
    with pytest.raises(BundleError, match="not left-padded"):
        NgramTable.load(broken("pad.npz", contexts=good["contexts"][:, ::-1]))
    with pytest.raises(BundleError, match="arrays of whole numbers"):
        NgramTable.load(broken("floats.npz", next=good["next"].astype(float)))
    with pytest.raises(BundleError, match="arrays of whole numbers"):
        NgramTable.load(broken("vocab.npz", vocab_size=np.array([8, 8])))
    with pytest.raises(BundleError, match="one row per context"):
        NgramTable.load(broken("rows.npz", total=good["total"][:-1]))
    rest = {k: v for k, v in good.items() if k != "total"}
    with open(tmp_path / "missing.npz", "wb") as f:
        np.savez(f, **rest)
    with pytest.raises(BundleError, match="missing array total"):
        NgramTable.load(tmp_path / "missing.npz")
    (tmp_path / "text.npz").write_text("not a table")
    with pytest.raises(BundleError, match="text.npz: not an n-gram table"):
        NgramTable.load(tmp_path / "text.npz")
    raw = (tmp_path / "rows.npz").read_bytes()
    for name, data in (("empty.npz", b""), ("cut.npz", raw[:100]), ("half.npz", raw[: len(raw) // 2])):
        (tmp_path / name).write_bytes(data)  # a crash (EOFError, BadZipFile) before: now the file, named
        with pytest.raises(BundleError, match=f"{name}: not an n-gram table"):
            NgramTable.load(tmp_path / name)


def test_a_table_declaring_more_than_it_could_hold_is_refused_unread(tmp_path):
    """A 0.6 MB file whose headers declare 600 MB of rows cost 225 MB of memory before its shape
    check; the headers are read first, and such a file is refused without reading its arrays."""
    import resource
    import zipfile

    rows = 30_000_000
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as z:
        for name, shape in (("contexts", (rows, 2)), *((n, (rows,)) for n in ("next", "count", "total"))):
            with z.open(f"{name}.npy", "w") as fh:  # zeros written a MiB at a time: this test holds none of it
                np.lib.format.write_array_header_1_0(fh, {"descr": "<i4", "fortran_order": False, "shape": shape})
                for _ in range(int(np.prod(shape)) * 4 >> 20):
                    fh.write(bytes(1 << 20))
                fh.write(bytes(int(np.prod(shape)) * 4 % (1 << 20)))
        with z.open("vocab_size.npy", "w") as fh:
            np.lib.format.write_array(fh, np.array(512, np.int32))
    assert (tmp_path / "bomb.npz").stat().st_size < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(BundleError, match="declare 600,000,004 bytes in a .*-byte file: refused unread"):
        NgramTable.load(tmp_path / "bomb.npz")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 32 << 10  # KiB: not one array read


def _ar(family, prompt, n=40):
    cfg = DecodeConfig(mode="ar", max_new_tokens=n)
    return [t for chunk in Decoder(family).generate(prompt, cfg) for t in chunk]


@pytest.fixture(scope="module")
def target_table(family):
    """The target's own greedy continuations of prompts other than PROMPTS, counted."""
    others = [[1, p, q] for p in (7, 21, 38, 52) for q in (4, 30)]
    return NgramTable.build([p + _ar(family, p) for p in others], vocab_size=64)


def test_decoding_with_the_table_gives_the_targets_tokens(family, target_table):
    decoder = Decoder(family, target_table)
    used = 0
    for prompt in PROMPTS:
        ar = _ar(family, prompt)
        for kw in (
            {"mode": "lookup", "k": 4},
            {"mode": "lookup", "k": 4, "table_k": 2, "adaptive": True},
            {"mode": "sd", "k": 3},
            {"mode": "sd", "k": 3, "lookup": True, "lookup_k": 8, "ngram_min": 2},
            {"mode": "pyramid", "variant": "exact", "l_D": 2, "l_Q": 6, "lookup": True},
        ):
            m = Metrics(kw["mode"])
            cfg = DecodeConfig(max_new_tokens=40, ngram_table=True, **kw)
            assert [t for chunk in decoder.generate(prompt, cfg, m) for t in chunk] == ar, kw
            used += m.num_accepted_tokens.get("table", 0)
            assert m.num_draft_tokens.get("table", 0) <= m.verify_steps * cfg.table_k
    assert used > 0  # the table did propose, and the target accepted some of it


def test_batched_requests_with_the_table_get_the_tokens_they_get_alone(family, target_table):
    """Under the server's continuous batching (kibidango.decode.batching) the table stays with the decoder."""
    from kibidango.decode.batching import Batcher
    from kibidango.pipeline import Pipeline
    from tests.test_batching import _together

    cfgs = [
        DecodeConfig(mode=m, k=3, lookup=True, max_new_tokens=12 + 2 * i, ngram_table=True)
        for i, m in enumerate(("lookup", "sd", "lookup", "sd"))
    ]
    alone = [_ar(family, p, c.max_new_tokens) for p, c in zip(PROMPTS, cfgs)]
    pipe = Pipeline(None, dict(family), cfgs[0], ngram_table=target_table)
    batcher = Batcher(pipe, slots=4)
    try:
        assert pipe.decoder.ngram_table is target_table
        assert _together(batcher, pipe, PROMPTS[:4], cfgs) == alone
    finally:
        batcher.close()
    assert pipe.decoder.ngram_table is target_table


def test_sampling_with_the_table_keeps_the_targets_distribution(family):
    """The table proposes one token after [1, 5, 9] (certain); the first sampled token still
    follows the target's distribution there."""
    table = NgramTable.build([[1, 5, 9, 12]] * 3, vocab_size=64)
    assert table.propose([1, 5, 9], 4) == [12]
    p = Sampler(temperature=1.0).probs(family["target"].new_session().feed([1, 5, 9])[-1])
    support = np.flatnonzero(p > 0.02)
    counts: dict[int, int] = {}
    n = 1500
    for seed in range(n):
        cfg = DecodeConfig(mode="lookup", max_new_tokens=2, temperature=1.0, seed=seed, ngram_table=True)
        first = next(Decoder({"target": family["target"]}, table).generate([1, 5, 9], cfg))[0]
        counts[first] = counts.get(first, 0) + 1
    observed = [counts.get(int(t), 0) for t in support] + [n - sum(counts.get(int(t), 0) for t in support)]
    expected = [n * p[t] for t in support] + [n * (1 - p[support].sum())]
    assert chisquare(observed, expected).pvalue > 0.001


def test_without_a_table_the_setting_is_refused(family):
    with pytest.raises(ValueError, match="ships no n-gram table"):
        next(Decoder(family).generate([1, 5], DecodeConfig(mode="lookup", ngram_table=True)))
    assert _ar(family, [1, 5], 4) == [  # ar never proposes: the setting is harmless there
        t
        for c in Decoder(family).generate([1, 5], DecodeConfig(mode="ar", ngram_table=True, max_new_tokens=4))
        for t in c
    ]
    with pytest.raises(ValueError, match="table_k must be >= 1"):
        DecodeConfig(table_k=0)


def test_a_bundle_ships_its_table_hashed(tmp_path):
    from kibidango import Pipeline, write_bundle
    from kibidango.bundle import load_bundle

    needs_stories()
    plain = Pipeline.from_bundle(
        write_bundle(tmp_path / "plain", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"}), mode="ar"
    )
    prompts = ["Once upon a time", "Lily and Ben went to the park", "The cat sat"]
    seqs = [plain.encode(p) + plain.generate(p, max_new_tokens=32).token_ids for p in prompts]

    def finalize(table):
        def write(root):
            (root / "ngrams").mkdir()
            table.save(root / "ngrams" / "ngrams.npz")
            return {"ngrams": "ngrams/ngrams.npz"}

        return write

    tiers = {"target": {"hf": STORIES, "vocab_size": 512}}
    bundle = write_bundle(
        tmp_path / "b", tiers, {"mode": "lookup"}, finalize=finalize(NgramTable.build(seqs, vocab_size=512))
    )
    pipe = Pipeline.from_bundle(bundle, ngram_table=True)
    prompt = "A little dog"
    got = pipe.generate(prompt, max_new_tokens=32)
    assert got.token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
    assert got.metrics.num_draft_tokens.get("table", 0) > 0

    def kb(*args):
        return subprocess.run([sys.executable, "-m", "kibidango", *args], capture_output=True, text=True, timeout=300)

    shown = kb("inspect", str(bundle))
    assert shown.returncode == 0 and "n-gram table: ngrams/ngrams.npz (" in shown.stdout
    cli = kb(
        "generate",
        "--bundle",
        str(bundle),
        "--ngram-table",
        "--table-k",
        "4",
        "--max-new-tokens",
        "32",
        "--stats",
        prompt,
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stderr[cli.stderr.index("{") :])["num_draft_tokens"].get("table", 0) > 0

    with pytest.raises(BundleError, match="ships no n-gram table"):
        Pipeline.from_bundle(tmp_path / "plain", mode="lookup", ngram_table=True)
    wrong = write_bundle(tmp_path / "w", tiers, {"mode": "lookup"}, finalize=finalize(NgramTable.build(seqs, 1024)))
    with pytest.raises(BundleError, match="counted over a vocabulary of 1024; the model has 512"):
        Pipeline.from_bundle(wrong)
    (bundle / "ngrams" / "ngrams.npz").write_bytes(b"tampered")
    with pytest.raises(BundleError, match="ngrams/ngrams.npz"):
        load_bundle(bundle)


def test_kibidango_ngram_table_writes_a_copy_that_ships_one(tmp_path):
    """`kibidango ngram-table` continues the prompts with the bundle's target, counts them and writes
    a copy of the bundle with the table (the source stays as it was); decoding with it is lossless."""
    from kibidango import Pipeline, write_bundle
    from kibidango.bundle import load_bundle

    needs_stories()
    src = write_bundle(tmp_path / "src", {"target": {"hf": STORIES, "vocab_size": 512}}, {"mode": "ar"})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nLily and Ben went to the park\nThe cat sat on the mat\n")
    made = subprocess.run(
        [sys.executable, "-m", "kibidango", "ngram-table", "--bundle", str(src), "--prompts", str(prompts)]
        + ["--out", str(tmp_path / "out"), "--max-new-tokens", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    assert "3/3 prompts continued" in made.stderr and "written:" in made.stdout
    out = load_bundle(tmp_path / "out")  # every file verified, the table among them
    assert out.manifest.ngrams == "ngrams/ngrams.npz" and any(f.path == "ngrams/ngrams.npz" for f in out.manifest.files)
    assert load_bundle(src).manifest.ngrams is None
    table = out.ngram_table(512)
    plain = Pipeline.from_bundle(src)
    assert len(table) == len(
        NgramTable.build(
            [
                plain.encode(p) + plain.generate(p, max_new_tokens=32).token_ids
                for p in prompts.read_text().splitlines()
            ],
            vocab_size=512,
        )
    )
    pipe = Pipeline.from_bundle(tmp_path / "out", mode="lookup", ngram_table=True)
    got = pipe.generate("A little dog", max_new_tokens=32)
    assert got.token_ids == plain.generate("A little dog", max_new_tokens=32).token_ids
