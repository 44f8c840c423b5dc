"""Caption building rules (docs/training.md#captions)."""

import random

import pytest

from anima_train.config.normalise import parse_protected_tags
from anima_train.data.captions import build_caption, caption_rng, read_caption_files, split_tags
from anima_train.config import CaptionConfig, ConfigError, load_config, parse_config

TAGS = "trigger, 1girl, solo, long hair, smile, red eyes, outdoors, sky, cloud, tree, dress, hat"
TAG_LIST = split_tags(TAGS, ", ")
NL = "A girl stands under a tree. She wears a red dress. Clouds drift overhead. A hat shades her eyes."


def opts(**kw):
    return CaptionConfig(**kw)


def many(options, tags=TAGS, nl=NL, n=200, seed=1, epoch=0):
    return [build_caption(tags, nl, options, seed, epoch, i) for i in range(n)]


def test_plain_tags_is_identity_after_normalising():
    assert build_caption(TAGS, NL, opts(), 0, 0, 0) == TAGS
    assert build_caption(" a ,b,, c ,", None, opts(), 0, 0, 0) == "a, b, c"
    assert build_caption("a | b|c", None, opts(tag_delimiter=" | "), 0, 0, 0) == "a | b | c"


def test_deterministic_per_seed_epoch_index_and_epochs_differ():
    o = opts(shuffle_tags=True, tag_dropout_percent=0.3, caption_mode="mixed", nl_shuffle_sentences=True)
    a = many(o, epoch=3)
    assert a == many(o, epoch=3)
    assert a != many(o, epoch=4)
    assert a != many(o, seed=2, epoch=3)
    assert len(set(a)) > 120  # indices get different streams (the ~50 "nl" draws have only 3! orders)
    # the stream does not depend on process state: a fresh generator gives the same numbers
    assert caption_rng(5, 6, 7).random() == caption_rng(5, 6, 7).random()


def test_no_global_rng_use():
    random.seed(1234)
    state = random.getstate()
    many(opts(shuffle_tags=True, tag_dropout_percent=0.5, caption_dropout_percent=0.1, caption_mode="mixed",
              nl_shuffle_sentences=True))
    assert random.getstate() == state
    # and global seeding does not change our captions
    random.seed(1)
    first = many(opts(shuffle_tags=True), n=20)
    random.seed(2)
    assert many(opts(shuffle_tags=True), n=20) == first


def test_caption_dropout_rate_and_first():
    out = many(opts(caption_dropout_percent=0.25), n=2000)
    assert 0.21 < out.count("") / len(out) < 0.29
    assert many(opts(caption_dropout_percent=1.0), n=20) == [""] * 20
    assert "" not in many(opts(caption_dropout_percent=0.0), n=500)
    # dropout is decided first: the same indices drop whatever the variant
    drop_tags = [c == "" for c in many(opts(caption_dropout_percent=0.3))]
    drop_nl = [c == "" for c in many(opts(caption_dropout_percent=0.3, caption_mode="nl"))]
    assert drop_tags == drop_nl


def test_fixed_modes_and_joins():
    assert build_caption(TAGS, NL, opts(caption_mode="nl"), 0, 0, 0) == NL
    assert build_caption(TAGS, NL, opts(caption_mode="tags_nl"), 0, 0, 0) == f"{TAGS}. {NL}"
    assert build_caption(TAGS, NL, opts(caption_mode="nl_tags"), 0, 0, 0) == f"{NL} {TAGS}"
    # NL alone when no tag is there
    assert build_caption("", NL, opts(caption_mode="nl_tags"), 0, 0, 0) == NL
    assert build_caption(" , ", NL, opts(caption_mode="tags_nl"), 0, 0, 0) == NL


@pytest.mark.parametrize("mode", ["nl", "tags_nl", "nl_tags"])
def test_nl_variant_without_nl_falls_back_to_tags(mode):
    assert build_caption(TAGS, None, opts(caption_mode=mode), 0, 0, 0) == TAGS
    assert build_caption(TAGS, "  \n", opts(caption_mode=mode), 0, 0, 0) == TAGS


def classify(c):
    if c == TAGS:
        return "tags"
    if c == NL:
        return "nl"
    return "tags_nl" if c.startswith(TAGS) else "nl_tags"


def test_mixed_weighted_draw():
    w = {"tags": 50, "nl": 10, "tags_nl": 20, "nl_tags": 20}
    out = [classify(c) for c in many(opts(caption_mode="mixed", mixed_weights=w), n=4000)]
    for v, weight in w.items():
        assert abs(out.count(v) / len(out) - weight / 100) < 0.03, (v, out.count(v))
    # zero and negative weights are never drawn (a negative one only by editing a built table: its constructor
    # refuses it, as load_config does)
    o = opts(caption_mode="mixed")
    o.mixed_weights = {"tags": 0, "nl": 1, "tags_nl": -3}
    out = {classify(c) for c in many(o)}
    assert out == {"nl"}
    # no positive weight -> tags
    assert set(many(opts(caption_mode="mixed", mixed_weights={"tags": 0, "nl": 0}), n=50)) == {TAGS}
    # default: equal weights over all four
    out = [classify(c) for c in many(opts(caption_mode="mixed"), n=2000)]
    assert all(0.2 < out.count(v) / len(out) < 0.3 for v in ("tags", "nl", "tags_nl", "nl_tags"))


def test_mixed_nl_draw_without_nl_gives_tags():
    out = many(opts(caption_mode="mixed", mixed_weights={"nl": 1}), nl=None, n=30)
    assert set(out) == {TAGS}


def test_bad_mode_and_weights_raise():
    # checked once, where the values enter: load_config, or the constructor of a table built in code
    with pytest.raises(ValueError, match="caption_mode"):
        opts(caption_mode="tag")
    with pytest.raises(ValueError, match="mixed_weights"):
        parse_config('[dataset]\npath = "/data/train"\n[dataset.caption]\nmixed_weights = { tagz = 1 }\n')


def test_tag_dropout_count_uses_round():
    # 12 tags, 2 pinned -> 10 droppable; 0.25 -> round(2.5) = 2 (Python rounds half to even)
    o = opts(tag_dropout_percent=0.25, shuffle_keep_first_n=2, min_tags_kept=0)
    assert {len(split_tags(c, ", ")) for c in many(o)} == {10}
    o = opts(tag_dropout_percent=0.35, min_tags_kept=0)  # 12 droppable -> round(4.2) = 4
    out = many(o)
    assert {len(split_tags(c, ", ")) for c in out} == {8}
    # surviving tags keep their original order when not shuffling
    for c in out:
        kept = split_tags(c, ", ")
        assert kept == [t for t in TAG_LIST if t in kept]
    assert len(set(out)) > 50  # different tags go on different draws


def test_min_tags_kept_floor():
    o = opts(tag_dropout_percent=1.0, min_tags_kept=3)
    assert {len(split_tags(c, ", ")) for c in many(o)} == {3}
    o = opts(tag_dropout_percent=1.0, min_tags_kept=20)  # more than there are: nothing dropped
    assert set(many(o, n=20)) == {TAGS}
    assert set(many(opts(tag_dropout_percent=1.0, min_tags_kept=0), n=20)) == {""}


def test_protected_tags_never_dropped_case_insensitive(tmp_path):
    o = opts(tag_dropout_percent=1.0, min_tags_kept=0, protected_tags=["Smile", "RED EYES"])
    assert set(many(o)) == {"smile, red eyes"}
    # protected_tags_file is read once, where it enters (load_config, relative to the config's folder)
    (tmp_path / "protected.txt").write_text("# my keepers\nSKY\n\n  tree  \n", encoding="utf-8")
    config = tmp_path / "c.toml"
    table = '[dataset]\npath = "/data/train"\n[dataset.caption]\ntag_dropout_percent = 1.0\nmin_tags_kept = 0\n'
    config.write_text(table + 'protected_tags_file = "protected.txt"\n')
    assert set(many(load_config(config).dataset.caption)) == {"sky, tree"}
    assert parse_protected_tags(["# c", "A ", ""]) == ["a"]
    config.write_text(table + 'protected_tags_file = "missing.txt"\n')
    with pytest.raises(ConfigError, match="protected_tags_file"):
        load_config(config)


def test_protected_tags_still_shuffle_and_count_toward_floor():
    o = opts(tag_dropout_percent=1.0, min_tags_kept=4, protected_tags=["smile"], shuffle_tags=True)
    for c in many(o):
        kept = split_tags(c, ", ")
        assert "smile" in kept and len(kept) == 4


def test_pinned_first_n_never_moved_or_dropped():
    o = opts(shuffle_tags=True, shuffle_keep_first_n=2, tag_dropout_percent=0.5, min_tags_kept=0)
    out = many(o)
    for c in out:
        assert split_tags(c, ", ")[:2] == ["trigger", "1girl"]
    tails = {tuple(split_tags(c, ", ")[2:]) for c in out}
    assert len(tails) > 100
    # shuffle without dropout is a permutation of the tail
    for c in many(opts(shuffle_tags=True, shuffle_keep_first_n=1)):
        kept = split_tags(c, ", ")
        assert kept[0] == "trigger" and sorted(kept) == sorted(TAG_LIST)
    assert len(set(many(opts(shuffle_tags=True)))) > 150


def test_nl_sentence_shuffle_keeps_first_and_trailing_period():
    sentences = ["A girl stands under a tree", "She wears a red dress", "Clouds drift overhead",
                 "A hat shades her eyes"]
    out = many(opts(caption_mode="nl", nl_shuffle_sentences=True))
    for c in out:
        assert c.endswith(".") and not c.endswith("..")
        parts = c[:-1].split(". ")
        assert parts[0] == sentences[0] and sorted(parts) == sorted(sentences)
    assert len(set(out)) == 6  # all 3! orders of the unpinned tail appear
    free = many(opts(caption_mode="nl", nl_shuffle_sentences=True, nl_keep_first_sentence=False))
    assert {c[:-1].split(". ")[0] for c in free} == set(sentences)
    # without the flag the NL text is used as written
    assert set(many(opts(caption_mode="nl"), n=20)) == {NL}


def test_read_caption_files(tmp_path):
    (tmp_path / "img.txt").write_text("a, b", encoding="utf-8")
    assert read_caption_files(tmp_path / "img") == ("a, b", None)
    (tmp_path / "img_nl.txt").write_text("An image.", encoding="utf-8")
    assert read_caption_files(tmp_path / "img") == ("a, b", "An image.")
    with pytest.raises(FileNotFoundError, match="other.txt"):
        read_caption_files(tmp_path / "other")


def test_caption_files_are_utf8_with_an_optional_bom(tmp_path):
    # Windows Notepad's "UTF-8 with BOM": the mark is not part of the first tag
    (tmp_path / "bom.txt").write_bytes("\ufeffcafé, 1girl".encode("utf-8"))
    (tmp_path / "bom_nl.txt").write_bytes("\ufeffA café.".encode("utf-8"))
    assert read_caption_files(tmp_path / "bom") == ("café, 1girl", "A café.")
    assert build_caption(*read_caption_files(tmp_path / "bom"), opts(), 0, 0, 0) == "café, 1girl"
    # Latin-1 / cp1252 is refused, naming the file and the fix (never decoded by guesswork)
    (tmp_path / "latin.txt").write_bytes("café, 1girl".encode("latin-1"))
    with pytest.raises(ValueError) as exc:  # CaptionError
        read_caption_files(tmp_path / "latin")
    msg = str(exc.value)
    assert str(tmp_path / "latin.txt") in msg and "not UTF-8" in msg and "0xe9" in msg and "re-save it as UTF-8" in msg


def test_config_caption_table_can_be_passed_through():
    config = pytest.importorskip("anima_train.config")
    c = config.CaptionConfig(tag_dropout_percent=1.0, min_tags_kept=0, protected_tags=["Smile"])
    c.file_protected_tags = ["sky"]  # what load_config reads from protected_tags_file
    assert build_caption(TAGS, NL, c, 0, 0, 0) == "smile, sky"
    c = config.CaptionConfig(caption_mode="mixed", mixed_weights={"nl": 1.0})
    assert build_caption(TAGS, NL, c, 0, 0, 0) == NL


def test_streams_are_independent_of_other_options():
    # the variant drawn under "mixed" does not change when dropout or shuffling is switched on
    base = [classify(c) for c in many(opts(caption_mode="mixed"))]
    other = many(opts(caption_mode="mixed", caption_dropout_percent=0.2, nl_shuffle_sentences=False))
    assert [classify(c) for c, b in zip(other, base) if c] == [b for c, b in zip(other, base) if c]
    # the tag shuffle does not depend on the variant that carries the tags
    shuffled = many(opts(shuffle_tags=True))
    in_tags_nl = many(opts(shuffle_tags=True, caption_mode="tags_nl"))
    assert [c.split(". ")[0] for c in in_tags_nl] == shuffled
