"""launch.StopFlag: SIGTERM / SIGINT in the main thread ask the loop to stop after its step; a loop run in another
thread (a Ray Train worker runs it so) installs nothing, where Python would refuse, and leaves signals alone."""
import os
import signal
import threading

from miles_k3.launch import StopFlag


def test_sigterm_in_the_main_thread_is_recorded_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    flag = StopFlag()
    assert flag.requested is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert flag.requested == "SIGTERM"
    flag.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_loop_in_another_thread_installs_no_handler():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = {}

    def loop():
        try:
            flag = StopFlag()
            seen["requested"] = flag.requested
            flag.restore()
        except ValueError as e:  # "signal only works in main thread of the main interpreter"
            seen["error"] = str(e)

    t = threading.Thread(target=loop)
    t.start()
    t.join()
    assert seen == {"requested": None}
    assert {s: signal.getsignal(s) for s in before} == before
