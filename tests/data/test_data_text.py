import random

import pytest
import torch

from sinkformer.data import bleu, load_dataset
from sinkformer.data.parallel_text import moses_like_tokenize, tokenized_bleu
from sinkformer.data.base import TokenCollate, TranslationCollate
from sinkformer.data.sentiment import INTENSIFIERS, NEGATIVE, NEGATORS, POSITIVE, generate_review
from sinkformer.data.text import BOS_ID, EOS_ID, PAD_ID, train_tokenizer
from sinkformer.data.translation import ADJECTIVES, DICTIONARY, NOUNS, VERBS, generate_pair

REVIEWS = {
    ("train", "pos"): ["A wonderful film.<br /><br />I loved it!", "Great acting, great story."],
    ("train", "neg"): ["Terrible. Just terrible.", "Boring plot<br />and dull acting."],
    ("test", "pos"): ["Loved the story."],
    ("test", "neg"): ["Dull and boring, " * 40],
}


def _write_imdb(root):
    for (split, label), texts in REVIEWS.items():
        folder = root / split / label
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"{i}_7.txt").write_text(text, encoding="utf-8")


def test_imdb_folder(tmp_path):
    _write_imdb(tmp_path / "aclImdb")
    data = load_dataset("imdb", tmp_path / "aclImdb", vocab_size=200, max_len=60)
    assert data.info["kind"] == "tokens" and data.info["n_classes"] == 2 and data.info["pad_id"] == PAD_ID
    assert len(data.train) == 4 and len(data.test) == 2
    assert [data.train[i][1] for i in range(4)] == [0, 0, 1, 1]  # neg first, then pos
    ids, _ = data.train[2]
    assert data.tokenizer.decode(ids.tolist()) == "a wonderful film. i loved it!"  # <br /> gone, lower-cased
    assert len(data.test[0][0]) == 60  # the long negative review, truncated to max_len
    (tmp_path / "aclImdb" / "train" / "pos" / "bad_1.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="cannot read review .*bad_1.txt"):
        load_dataset("imdb", tmp_path / "aclImdb", vocab_size=200)


def test_imdb_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="aclImdb_v1.tar.gz"):
        load_dataset("imdb", tmp_path / "aclImdb")
    (tmp_path / "aclImdb" / "train" / "pos").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="missing folder .*neg"):
        load_dataset("imdb", tmp_path / "aclImdb")


def test_tokenizer_is_trained_on_the_texts_and_deterministic():
    texts = ["the movie was not good", "the plot was very dull", "a truly wonderful cast"] * 5
    a, b = train_tokenizer(texts, 60), train_tokenizer(texts, 60)
    assert a.get_vocab() == b.get_vocab()
    assert [a.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<unk>")] == [PAD_ID, BOS_ID, EOS_ID, 3]
    assert a.decode(a.encode("The Movie was good").ids) == "the movie was good"


def _label_by_rule(review: str) -> int:
    """The documented rule, re-implemented independently of the generator."""
    clauses, weights = [[]], [1]
    for word in review.split():
        if word in ("and", "but"):
            clauses.append([])
            weights.append(3 if word == "but" else 1)
        else:
            clauses[-1].append(word)
    score = 0
    for words, weight in zip(clauses, weights):
        value = 1 if any(w in POSITIVE for w in words) else -1
        assert sum(w in POSITIVE or w in NEGATIVE for w in words) == 1
        value *= -1 if any(w in NEGATORS for w in words) else 1
        value *= 2 if any(w in INTENSIFIERS for w in words) else 1
        score += weight * value
    return int(score > 0)


def test_generated_sentiment_labels_follow_negation_intensity_and_contrast():
    rng = random.Random(5)
    reviews = [generate_review(rng) for _ in range(300)]
    assert all(_label_by_rule(text) == label for text, label in reviews)
    assert any(" but " in text for text, _ in reviews) and any(" not " in text for text, _ in reviews)
    # context matters: reviews with the same positive adjective get both labels
    good = [label for text, label in reviews if "good" in text.split()]
    assert 0 in good and 1 in good
    data = load_dataset("sentiment", n_train=100, n_test=20)
    assert 0.3 < sum(data.train.labels) / 100 < 0.7


def test_token_collate_pads_and_masks():
    inputs, labels = TokenCollate(PAD_ID)([(torch.tensor([5, 6, 7]), 1), (torch.tensor([8]), 0)])
    assert inputs["tokens"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert inputs["padding_mask"].tolist() == [[False, False, False], [False, True, True]]
    assert labels.tolist() == [1, 0]


def test_translation_collate_shifts_targets():
    src = [torch.tensor([5, 6, EOS_ID]), torch.tensor([7, EOS_ID])]
    tgt = [torch.tensor([BOS_ID, 9, EOS_ID]), torch.tensor([BOS_ID, 10, 11, EOS_ID])]
    inputs, targets = TranslationCollate(PAD_ID)(list(zip(src, tgt)))
    assert inputs["tgt"].tolist() == [[BOS_ID, 9, 0], [BOS_ID, 10, 11]]
    assert targets.tolist() == [[9, EOS_ID, 0], [10, 11, EOS_ID]]
    assert inputs["tgt_padding_mask"].tolist() == [[False, False, True], [False, False, False]]
    assert inputs["src_padding_mask"].tolist() == [[False, False, False], [False, False, True]]


def _write_parallel(root, split, pairs):
    (root / f"{split}.de").write_text("".join(de + "\n" for de, _ in pairs), encoding="utf-8")
    (root / f"{split}.en").write_text("".join(en + "\n" for _, en in pairs), encoding="utf-8")


def test_iwslt_parallel_text(tmp_path):
    train = [("ich sehe den hund .", "i see the dog ."), ("der hund sieht mich .", "the dog sees me ."),
             ("das haus ist gro@@ ß .", "the house is big ."), ("", "dropped because the source is empty")]
    _write_parallel(tmp_path, "train", train)
    _write_parallel(tmp_path, "valid", [("ich sehe das haus .", "I see the house .")])
    data = load_dataset("iwslt14", tmp_path, vocab_size=120, max_len=64)
    assert data.info["kind"] == "translation" and data.info["bos_id"] == BOS_ID and len(data.train) == 3
    src, tgt = data.train[2]
    assert src[-1].item() == EOS_ID and tgt[0].item() == BOS_ID and tgt[-1].item() == EOS_ID
    assert data.tokenizer.decode(src.tolist(), skip_special_tokens=True) == "das haus ist groß ."  # @@ removed
    assert data.test.references == ["I see the house ."]
    (tmp_path / "valid.en").write_text("one\ntwo\n")
    with pytest.raises(ValueError, match="valid.de has 1 lines but .*valid.en has 2"):
        load_dataset("iwslt14", tmp_path)
    with pytest.raises(FileNotFoundError, match="prepare-iwslt14.sh"):
        load_dataset("iwslt14", tmp_path, eval_split="test")


def test_iwslt_evaluation_split_is_the_one_asked_for_and_named(tmp_path):
    _write_parallel(tmp_path, "train", [("ich sehe den hund .", "i see the dog ."), ("der hund sieht mich .", "the dog sees me .")])
    _write_parallel(tmp_path, "valid", [("ich sehe das haus .", "i see the house .")])
    _write_parallel(tmp_path, "test", [("der hund .", "the dog ."), ("das haus ist gro@@ ß .", "the house is big .")])
    test = load_dataset("iwslt14", tmp_path, vocab_size=120, eval_split="test")
    assert test.test.references == ["the dog .", "the house is big ."] and len(test.test) == 2
    assert test.info["eval_split"] == "test"
    valid = load_dataset("iwslt14", tmp_path, vocab_size=120)  # the loader's default: the validation set
    assert valid.test.references == ["i see the house ."] and valid.info["eval_split"] == "valid"
    assert load_dataset("translation", n_train=20, n_test=3).info["eval_split"] == "test"  # generated, held out


def _translate_by_rule(source: str) -> str:
    """The documented grammar, re-implemented: NP verb NP [prep NP] -> NP' NP' [prep' NP'] verb'."""
    words, phrases, verb = source.split(), [], None
    i = 0
    while i < len(words):
        if words[i] in VERBS:
            verb, i = words[i], i + 1
        elif words[i] in ("near", "behind", "under"):
            phrases.append([DICTIONARY[words[i]]])
            i += 1
        else:  # determiner [adjective] noun -> determiner noun [adjective]
            det, rest = words[i], []
            i += 1
            while words[i] not in NOUNS:
                rest.append(words[i])
                i += 1
            phrases.append([DICTIONARY[det], DICTIONARY[words[i]]] + [DICTIONARY[a] for a in rest])
            i += 1
    return " ".join(w for phrase in phrases for w in phrase) + " " + DICTIONARY[verb]


def test_generated_translation_maps_words_and_moves_the_verb_last():
    rng = random.Random(3)
    pairs = [generate_pair(rng) for _ in range(100)]
    assert all(tgt == _translate_by_rule(src) for src, tgt in pairs)
    assert any(len(src.split()) > 8 for src, _ in pairs)
    assert any(w in ADJECTIVES for src, _ in pairs for w in src.split())
    data = load_dataset("translation", n_train=50, n_test=5)
    assert data.info["max_len"] >= max(len(x) for x, _ in data.train)


def test_bleu():
    refs = ["the cat sat on the mat", "a dog barked loudly at night"]
    assert bleu(refs, refs) == pytest.approx(100.0)
    assert bleu(["completely unrelated words here", "nothing matches"], refs) < 5.0
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        bleu(refs, refs[:1])


def test_tokenized_bleu_scores_lowercased_moses_like_tokens():
    refs = ["It's a dog, isn't it?", "The house is big."]
    assert tokenized_bleu(refs, refs) == pytest.approx(100.0)
    assert moses_like_tokenize("Hello, world! It's 3.5 &quot;well-known&quot; 1,000 (ok) dogs' ted.com.") == (
        'Hello , world ! It \'s 3.5 " well-known " 1,000 ( ok ) dogs \' ted.com .')
    # prepare-iwslt14.sh's text (Moses-tokenised, escaped, lower-cased) has the same tokens: tokenised BLEU 100
    moses = ["it &apos;s a dog , isn &apos;t it ?", "the house is big ."]
    assert moses_like_tokenize(moses[0]) == "it 's a dog , isn 't it ?"
    assert tokenized_bleu(moses, refs) == pytest.approx(100.0)
    assert bleu(moses, refs) < 50.0  # sacreBLEU is case-sensitive and keeps "&apos;" and "It's" as they are
    assert bleu([r.lower() for r in refs], refs) < 100.0 and tokenized_bleu([r.upper() for r in refs], refs) == pytest.approx(100.0)
    spaced = ["It 's a dog , isn 't it ?", "The house is big ."]  # punctuation split off: no difference for either
    assert tokenized_bleu(spaced, refs) == pytest.approx(100.0) and bleu(spaced, refs) < 100.0
    assert bleu(["It's a dog , isn't it ?", "The house is big ."], refs) == pytest.approx(100.0)  # 13a splits "," too
    no_comma = ["It's a dog isn't it?", "The house is big."]  # a missing comma lowers both
    assert tokenized_bleu(no_comma, refs) < 100.0 and bleu(no_comma, refs) < 100.0
    assert tokenized_bleu(["completely unrelated words here", "nothing matches"], refs) < 5.0
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        tokenized_bleu(refs, refs[:1])
