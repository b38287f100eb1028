"""The tokenizer's helper process: a server's long texts are encoded there, at low priority, to the same ids;
a helper that dies fails the call that was waiting and is replaced for the next."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from zhuzi.encoder_process import LONG_TEXT, NICENESS, in_slices
from zhuzi.tokenizer import Tokenizer

# Long enough for the helper, with what tokenizing must get right: special-token strings (control ids in a
# raw prompt), multi-byte characters, and a text cut where a slice of ids ends.
LONG = ("Hello <|im_start|>user 世界, naïve café 🙂\n" * (3 * LONG_TEXT // 40))[: 3 * LONG_TEXT - 7]


@pytest.fixture(scope="module")
def with_helper(smollm2_path: Path) -> Tokenizer:
    tok = Tokenizer.load(smollm2_path)
    tok.use_encoder_process()
    yield tok
    tok.encoder.process.kill()


def test_long_texts_get_the_ids_the_tokenizer_gives_in_thread(with_helper: Tokenizer,
                                                              smollm2_tokenizer: Tokenizer) -> None:
    assert len(LONG) > LONG_TEXT
    for encode in (lambda t: t.encode_prompt(LONG), lambda t: t.encode(LONG)):
        assert encode(with_helper) == encode(smollm2_tokenizer)
    assert smollm2_tokenizer.encoder is None and with_helper.encoder.process.poll() is None
    assert os.getpriority(os.PRIO_PROCESS, with_helper.encoder.process.pid) == NICENESS


def test_a_helper_that_dies_fails_the_waiting_call_and_the_next_gets_a_new_one(
        with_helper: Tokenizer, smollm2_tokenizer: Tokenizer) -> None:
    first = with_helper.encoder.process
    huge = LONG * 60  # ~12 MB: seconds of encoding, ample time to be killed in the middle
    failed: list[Exception] = []

    def encode() -> None:
        try:
            with_helper.encode(huge)
        except RuntimeError as exc:
            failed.append(exc)

    waiting = threading.Thread(target=encode)
    waiting.start()
    time.sleep(0.5)
    os.kill(first.pid, signal.SIGKILL)
    waiting.join(timeout=10)
    assert not waiting.is_alive() and [str(e) for e in failed] == ["the tokenizer process died"]
    assert with_helper.encode(LONG) == smollm2_tokenizer.encode(LONG)
    assert with_helper.encoder.process.pid != first.pid and with_helper.encoder.process.poll() is None


def test_a_group_sigterm_leaves_the_helper_to_the_server_which_ends_it_by_hanging_up(
        smollm2_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    """A supervisor's SIGTERM reaches every process of the group: the helper stays for the requests the server
    drains, and ends when the server hangs up (as it does on its way out)."""
    tok = Tokenizer.load(smollm2_path)
    tok.use_encoder_process()
    helper = tok.encoder.process
    assert tok.encode(LONG) == smollm2_tokenizer.encode(LONG)  # the helper is up and serving
    os.kill(helper.pid, signal.SIGTERM)
    assert tok.encode(LONG) == smollm2_tokenizer.encode(LONG) and tok.encoder.process is helper
    tok.encoder.hang_up()
    assert helper.wait(timeout=30) == 0


def test_in_slices_is_the_one_call_it_stands_for() -> None:
    items = list(range(3 * 65536 + 5))
    assert in_slices(lambda part: [i * 2 for i in part], items) == [i * 2 for i in items]
    assert in_slices(list, []) == []
