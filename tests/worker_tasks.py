"""Tasks for the worker tests: importable by the spawned child."""

import ctypes
import os
import time


def add(a, b):
    return a + b


def pid():
    return os.getpid()


def env(name):
    return os.environ.get(name)


def boom():
    raise ValueError("bad kernel")


def segfault():
    ctypes.string_at(0)  # reads address 0: SIGSEGV, as an illegal memory access would


def hard_exit():
    os._exit(3)


def hang(seconds):
    time.sleep(seconds)
    return "woke"


def unpicklable():
    return lambda: None
