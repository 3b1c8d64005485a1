"""Which processes listen where: a process tree and its listening TCP sockets, from /proc."""
from __future__ import annotations

import glob
import ipaddress
import os


def process_tree(root: int) -> set[int]:
    """``root`` and every process below it (from /proc)."""
    parent = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
            parent[int(stat.split("/")[2])] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, grown = {root}, True
    while grown:
        below = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= below
        grown = bool(below)
    return tree


def listening(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every listening TCP socket those processes hold (from /proc)."""
    owner = {}
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in owner:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
            out.append((owner[fields[9]], str(ipaddress.ip_address(words)), int(port, 16)))
    return out


def loopback(address) -> bool:
    """An IPv4 or IPv6 loopback address, or an IPv4 one mapped into IPv6."""
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from an IPv6 socket
    return (mapped or address).is_loopback
