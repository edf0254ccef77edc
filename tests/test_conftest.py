"""The tests' own locks (conftest.py): under pytest-xdist a test marked `alone` runs while no
other test does, and tests that arrive while it waits for the room wait for it."""
from __future__ import annotations

import threading
import time

from conftest import alone, together


def test_an_alone_test_waits_for_those_running_and_those_after_it_wait_for_it(tmp_path):
    gate, room = str(tmp_path / "gate"), str(tmp_path / "room")
    events, running = [], threading.Event()

    def first():
        with together(gate, room):
            running.set()
            time.sleep(0.3)
            events.append("first ends")

    def lone():
        with alone(gate, room):
            events.append("alone runs")
            time.sleep(0.2)
            events.append("alone ends")

    def later():
        with together(gate, room):
            events.append("later runs")

    threads = [threading.Thread(target=first)]
    threads[0].start()
    running.wait()
    threads.append(threading.Thread(target=lone))
    threads[1].start()
    time.sleep(0.1)  # the alone test holds the gate, waiting for the room
    threads.append(threading.Thread(target=later))
    threads[2].start()
    for t in threads:
        t.join(10)
    assert events == ["first ends", "alone runs", "alone ends", "later runs"]


def test_tests_together_run_at_once(tmp_path):
    gate, room = str(tmp_path / "gate"), str(tmp_path / "room")
    inside, both = [], threading.Barrier(2, timeout=5)

    def one():
        with together(gate, room):
            inside.append(1)
            both.wait()  # would time out if the second could not enter beside the first

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert inside == [1, 1]
