"""A host map ``{host: ranks}`` (``hosts_from_map``, ``tritonreshard plan --hosts``): read into
``{rank: host}`` for exactly a group's ranks, or refused before anything is set up with one message
naming every problem."""
import json

import pytest

from tritonreshard.apps.cli import main
from tritonreshard.planning import hosts_from_map


def _problems(host_map, ranks) -> list[str]:
    """The problems one ValueError names, one a line."""
    with pytest.raises(ValueError) as exc:
        hosts_from_map(host_map, ranks)
    head, *lines = str(exc.value).split("\n  - ")
    assert head == f"host map: {len(lines)} problem(s):", str(exc.value)
    return lines


def test_every_problem_of_a_host_map_is_named_in_one_message():
    planted = {
        "node0": [0, 1, 2, 2, True, -1, "3"],   # bad ranks (bool, negative, str); 2 twice on one host is fine
        "": [3],                                # empty name
        7: [4],                                 # name not a str
        "node3": [],                            # no rank
        "node4": [40, 41, 42],                  # on no rank of the group
        "node5": [5, 6, 9],                     # 9: not in the group; 5 also on two other hosts
        "node6": [5, 7],
        "node7": (5,),
        "node8": "8-9",                         # a str, not ranks
    }
    assert _problems(planted, [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, -3, 2.0]) == [
        "ranks lists -3, 2.0: not ranks (ints >= 0)",
        "host 'node0' lists True, -1, '3': not ranks (ints >= 0)",
        "host name '' is not a non-empty string",
        "host name 7 is not a non-empty string",
        "host 'node3' has no rank",
        "host 'node4' is on no rank of the group: its rank(s) 40-42 are not among ranks 0-8,10-11",
        "host 'node5' lists rank(s) 9, not in the group (ranks 0-8,10-11)",
        "host 'node8': its ranks must be an iterable of ints >= 0, got '8-9'",
        "rank(s) 5 on 3 hosts: 'node5', 'node6', 'node7' (a rank is on one host)",
        "rank(s) 8,10-11 of the group on no host",
    ]
    # Ranks on the same hosts are named together, as runs; a rank listed twice by one host is not shared.
    assert _problems({"a": range(8), "b": range(2, 6), "c": [0, 0]}, range(8)) == [
        "rank(s) 0 on 2 hosts: 'a', 'c' (a rank is on one host)",
        "rank(s) 2-5 on 2 hosts: 'a', 'b' (a rank is on one host)"]
    with pytest.raises(TypeError, match="host_map must be a mapping"):
        hosts_from_map([("node0", [0])], [0])


@pytest.mark.parametrize("per_host, world", [(1, 3), (2, 6), (4, 10), (8, 16)])
def test_a_map_of_consecutive_ranks_is_what_hosts_of_gives(per_host, world):
    expected = {r: f"host{r // per_host}" for r in range(world)}   # the CLI's --hosts-of
    host_map = {f"host{k}": range(k * per_host, min(world, (k + 1) * per_host))
                for k in range(-(-world // per_host))}
    assert hosts_from_map(host_map, range(world)) == expected
    shuffled = {h: sorted(rs, reverse=True) for h, rs in reversed(list(host_map.items()))}   # any order
    assert list(hosts_from_map(shuffled, iter(range(world - 1, -1, -1))).items()) == list(expected.items())


def test_hosts_need_not_be_consecutive():
    assert hosts_from_map({"a": {0, 2}, "b": (1, 3)}, [3, 2, 1, 0]) == {0: "a", 1: "b", 2: "a", 3: "b"}


def test_the_cli_refuses_a_bad_map_before_reading_the_config(tmp_path, capsys):
    missing = tmp_path / "never-read.json"   # a refusal after the map's check would be FileNotFoundError
    argv = ["plan", "--model", str(missing), "--trainers", "2", "--tp", "2", "--replicas", "2",
            "--hosts", "node0=0-1,7", "--hosts", "node1=1-2", "--hosts", "node2=", "--hosts", "node3=9-12"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    with pytest.raises(ValueError) as exc:   # the library's own message, word for word
        hosts_from_map({"node0": [0, 1, 7], "node1": [1, 2], "node2": [], "node3": [9, 10, 11, 12]}, range(6))
    assert out == "" and err == f"tritonreshard plan: error: {exc.value}\n"
    assert err == ("tritonreshard plan: error: host map: 5 problem(s):\n"
                   "  - host 'node0' lists rank(s) 7, not in the group (ranks 0-5)\n"
                   "  - host 'node2' has no rank\n"
                   "  - host 'node3' is on no rank of the group: its rank(s) 9-12 are not among ranks 0-5\n"
                   "  - rank(s) 1 on 2 hosts: 'node0', 'node1' (a rank is on one host)\n"
                   "  - rank(s) 3-5 of the group on no host\n")
    # The syntax, every entry that does not parse; --hosts with --hosts-of; --hosts without --model.
    assert main(argv[:9] + ["--hosts", "node0", "--hosts", "a=1-0,x", "--hosts", "a=0", "--hosts", "b=0-9999999"]) == 2
    err = capsys.readouterr().err
    for line in ("--hosts 'node0' must be NAME=RANKS", "--hosts 'a=1-0,x': '1-0' is not a rank or a range a-b",
                 "--hosts 'a=1-0,x': 'x' is not", "--hosts names host 'a' twice", "--hosts 'b=0-9999999': '0-9999999'"):
        assert line in err, err
    assert main(argv + ["--hosts-of", "2"]) == 2
    assert "--hosts and --hosts-of both place ranks on hosts" in capsys.readouterr().err
    assert main(["plan", "--hosts", "node0=0-5"]) == 2
    assert "add --model" in capsys.readouterr().err


def test_the_cli_with_a_map_prints_what_hosts_of_prints(tmp_path, capsys):
    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    argv = ["plan", "--model", str(path), "--trainers", "2", "--tp", "2", "--replicas", "2", "--all-ops"]

    def run(*flags):
        assert main(argv + list(flags)) == 0
        return [s for s in capsys.readouterr().out.splitlines() if not s.startswith("planning (this machine")]

    by_count = run("--hosts-of", "2")
    by_map = run("--hosts", "host0=0-1", "--hosts", "host1=2,3", "--hosts", "host2=4-5")
    assert by_count[0].endswith("3 host(s) of 2 ranks") and by_map[0].endswith("3 host(s) from --hosts")
    assert by_map[1:] == by_count[1:]
    assert "2 host(s) receive from other hosts" in "\n".join(by_map)
    # Longer names widen the host column; the rows say each rank's host.
    named = run("--hosts", "trainers=0-1", "--hosts", "replica-zero=2-3", "--hosts", "r1=4,5")
    assert any(s.startswith(" rank         host role") for s in named)
    assert any(s.startswith("    3 replica-zero replica 0 TP 1") for s in named)
