"""Run a script with the network cut off: ``python tests/no_network.py SCRIPT ARGS...``.

Any name lookup or connection (``socket.getaddrinfo``, ``connect``, ``create_connection``:
what huggingface_hub's and datasets' HTTP clients reach first) prints ``NETWORK ATTEMPT``
with what was asked on stderr and ends the process with exit code 99, so a test sees a
network attempt even where a library would catch the error and retry. Binding a local
port (pretrain_gpt.py's single-process rendezvous) is allowed.
"""

import os
import runpy
import socket
import sys

NETWORK_EXIT = 99


def _refuse(*args, **kwargs):
    asked = [a for a in args if not isinstance(a, socket.socket)][:1]
    os.write(2, f"NETWORK ATTEMPT {asked}\n".encode())
    os._exit(NETWORK_EXIT)


socket.getaddrinfo = _refuse
socket.create_connection = _refuse
socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
