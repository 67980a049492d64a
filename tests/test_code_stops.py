"""llama.cpp's code-completion stops on a sequence: ``n_indent`` (a new line indented less ends the
reply after its indentation; the line is held back from the stream until its indentation is known)
and ``t_max_predict_ms`` (past the limit, a reply holding a new line ends)."""
from __future__ import annotations

import time

import pytest

from tokenleap.config import ConfigError, SamplingParams
from tokenleap.spec.sequence import Sequence

from conftest import ToyDetokenizer

PIECES = {3: "x = 1", 4: "\n", 5: "    ", 6: "y", 7: "\n", 8: "z", 9: "  ", 10: "w"}


class Pieces:
    def piece(self, i: int) -> str:
        return PIECES[i]


def sequence(**kw) -> Sequence:
    return Sequence(seq_id=0, prompt=[1], params=SamplingParams(max_tokens=50, **kw), eos_ids=frozenset({2}),
                    detokenizer=ToyDetokenizer(Pieces()))


def test_a_line_indented_less_than_n_indent_ends_the_reply_after_its_indentation():
    seq = sequence(n_indent=4)
    assert seq.append([3, 4, 5, 6]) == 4 and not seq.finished  # "    y": indented enough
    assert seq.take_text() == "x = 1\n    y"
    assert seq.append([7, 9]) == 2 and not seq.finished  # "\n  ": the new line's indentation not known yet
    assert seq.take_text() == ""  # held back
    assert seq.append([10, 3, 4]) == 1 and seq.finish_reason == "length"  # "  w": 2 < 4, the rest unused
    assert seq.text == "x = 1\n    y\n  " and seq.take_text() == "\n  "
    flat = sequence(n_indent=4)
    assert flat.append([3, 4, 8, 4]) == 3 and flat.text == "x = 1\n"  # no indentation at all
    free = sequence()
    assert free.append([3, 4, 8, 4]) == 4 and not free.finished and free.take_text() == "x = 1\nz\n"


def test_past_t_max_predict_ms_a_reply_with_a_new_line_ends():
    seq = sequence(t_max_predict_ms=5)
    assert seq.append([3]) == 1  # the first token starts the clock
    time.sleep(0.02)
    assert seq.append([6]) == 1 and not seq.finished  # late, but no new line yet
    assert seq.append([4, 6, 6]) == 1 and seq.finish_reason == "length" and seq.text == "x = 1y\n"
    early = sequence(t_max_predict_ms=60_000)
    assert early.append([3, 4, 6, 4, 6]) == 5 and not early.finished
    for bad in (dict(n_indent=-1), dict(n_indent=True), dict(t_max_predict_ms=-1.0),
                dict(t_max_predict_ms=float("inf"))):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_a_stream_holds_back_only_text_a_stop_string_could_still_start_with():
    """Text is held back while its ending could begin a stop string, no more (llama.cpp's rule): "x = 1"
    goes out whole beside a stop "\\n    q"; "\\n" and then "\\n    " wait; a "y" after them shows they
    were not the stop's start."""
    seq = sequence(stop=("\n    q", "zz"))
    assert seq.append([3]) == 1 and seq.take_text() == "x = 1"
    assert seq.append([4]) == 1 and seq.take_text() == ""  # "\n" may begin "\n    q"
    assert seq.append([5]) == 1 and seq.take_text() == ""  # so may "\n    "
    assert seq.append([6]) == 1 and seq.take_text() == "\n    y"  # "y": not the stop after all
    assert seq.append([8]) == 1 and seq.take_text() == ""  # "z" may begin "zz"
    assert seq.append([8]) == 1 and seq.finished and seq.text == "x = 1\n    y" and seq.take_text() == ""


def test_the_held_back_ending_is_the_longest_that_begins_a_stop_string():
    """``OpenStops`` (read incrementally, each character once) against the definition: the longest
    ending of the text that is a proper prefix of some stop string, over random texts that grow in
    random pieces and stop strings that overlap themselves (and match whole inside min_tokens)."""
    import random
    from tokenleap.spec.stop_strings import OpenStops

    def by_definition(text, stops):
        return max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)

    rng = random.Random(0)
    for trial in range(2000):
        alphabet = "ab" if trial % 2 else "abc"
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        scan, text = OpenStops(stops), ""
        for _ in range(rng.randint(1, 10)):
            text += "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
            assert scan.open_length(text) == by_definition(text, stops), (stops, text)
