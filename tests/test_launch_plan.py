"""`gossiptrain launch`'s plan, without ssh: the hostfile, who runs where, the commands, the agent's lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossiptrain.errors import ConfigError
from gossiptrain.runtime.launch_plan import (
    AGENT_MARK,
    DEFAULT_PORT,
    AgentRequest,
    Host,
    check_ssh_template,
    control_line,
    host_port,
    parse_control,
    parse_hostfile,
    parse_report,
    plan_launch,
    read_hostfile,
    split_words,
    ssh_prefix,
    started_report,
)

HOSTFILE = """\
# the cluster
node1 slots=0            # the coordinator alone
alice@node2 slots=2
node3   address=10.0.0.3
[fe80::1]
"""


def test_a_hostfile_reads_like_mpis_with_comments_users_and_addresses() -> None:
    hosts = parse_hostfile(HOSTFILE, "hosts.txt")
    assert [(h.target, h.slots, h.address) for h in hosts] == [
        ("node1", 0, None), ("alice@node2", 2, None), ("node3", None, "10.0.0.3"), ("[fe80::1]", None, None),
    ]
    assert hosts[1].name == "node2" and hosts[1].user == "alice" and hosts[0].user == ""
    assert hosts[2].where == "hosts.txt:4"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("node1 slots=two", "hosts.txt:2: 'slots=two': slots must be a whole number >= 0"),
        ("node1 slots=-1", "hosts.txt:2: 'slots=-1': slots must be a whole number >= 0"),
        ("node1 cpus=4", "hosts.txt:2: 'cpus=4' is not understood (slots=N or address=ADDR)"),
        ("node1 4", "hosts.txt:2: '4' is not understood"),
        ("slots=2", "hosts.txt:2: 'slots=2' is not a host"),
        ("@node1", "hosts.txt:2: '@node1' is not a host"),
        ("bad/host", "hosts.txt:2: 'bad/host' is not a host"),
        ("node0", "hosts.txt:2: node0 is listed twice (first at hosts.txt:1; give it slots=N instead)"),
    ],
)
def test_a_malformed_line_names_the_file_and_line(line: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_hostfile(f"node0\n{line}\n", "hosts.txt")
    assert str(e.value).startswith(message), str(e.value)


def test_an_empty_or_missing_hostfile_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"empty.txt: no hosts"):
        parse_hostfile("# nothing\n\n", "empty.txt")
    with pytest.raises(ConfigError, match=r"--hosts .*missing.txt: cannot read it"):
        read_hostfile(tmp_path / "missing.txt")


def test_the_coordinator_goes_first_and_slots_say_how_many_peers_each_host_runs() -> None:
    plan = plan_launch(parse_hostfile(HOSTFILE, "h"), peers_per_host=3)
    assert plan.coordinator.host.target == "node1" and plan.coordinator.label == "node1"
    # node1 slots=0: none; node2 slots=2 (slots win over the flag); the others --peers-per-host
    assert [(p.index, p.host.target) for p in plan.peers] == [
        (0, "alice@node2"), (1, "alice@node2"), (2, "node3"), (3, "node3"), (4, "node3"),
        (5, "[fe80::1]"), (6, "[fe80::1]"), (7, "[fe80::1]"),
    ]
    # a host that runs several processes labels each one's output lines
    assert [p.label for p in plan.peers[:2]] == ["alice@node2/peer0", "alice@node2/peer1"]
    assert plan.peers[0].name == "peer 0 on alice@node2"


def test_a_host_with_the_coordinator_and_a_peer_labels_both() -> None:
    plan = plan_launch([Host("a"), Host("b")])
    assert plan.coordinator.label == "a/coordinator"
    assert [p.label for p in plan.peers] == ["a/peer0", "b"]


def test_the_coordinator_host_may_be_named_in_the_file_or_outside_it() -> None:
    hosts = [Host("alice@a"), Host("b")]
    assert plan_launch(hosts, coordinator_host="b").coordinator.host.target == "b"
    assert plan_launch(hosts, coordinator_host="a").coordinator.host.target == "alice@a"  # by name, without user@
    outside = plan_launch(hosts, coordinator_host="login1")
    assert outside.coordinator.host.target == "login1" and outside.coordinator.label == "login1"
    assert [p.host.target for p in outside.peers] == ["alice@a", "b"]
    with pytest.raises(ConfigError, match="--coordinator-host: 'no host' is not a host"):
        plan_launch(hosts, coordinator_host="no host")


def test_no_peer_at_all_is_refused() -> None:
    with pytest.raises(ConfigError, match="no peers to start"):
        plan_launch([Host("a", slots=0)])
    with pytest.raises(ConfigError, match="no peers to start"):
        plan_launch([Host("a")], peers_per_host=0)


def test_the_commands_carry_the_join_address_and_fill_in_index_and_host() -> None:
    plan = plan_launch(
        [Host("u@a", slots=0), Host("u@b", slots=2)],
        remote_command=["python3", "-m", "gossiptrain"],
        coordinator_args=["--steps", "10"],
        peer_args=["--metrics", "run/{host}-{index}.jsonl", "--set", 'x={"json": 1}'],
    )
    assert plan.coordinator_command("10.0.0.1:29400") == ["coordinator", "--bind", "10.0.0.1:29400", "--steps", "10"]
    assert plan.peer_command(plan.peers[1], "10.0.0.1:29400") == [
        "peer", "--join", "10.0.0.1:29400", "--metrics", "run/b-1.jsonl", "--set", 'x={"json": 1}']  # other braces stay
    # the agent starts through the ssh template with the remote command; it runs the commands above with its own python
    assert plan.agent_command("ssh -p 2222 {host}", plan.peers[1]) == [
        "ssh", "-p", "2222", "u@b", "python3", "-m", "gossiptrain", "launch-agent"]


def test_a_hosts_address_is_what_its_peers_advertise_unless_the_user_says_otherwise() -> None:
    plan = plan_launch([Host("a", slots=0), Host("b", slots=1, address="10.0.0.3"), Host("c", slots=1)])
    assert plan.peer_command(plan.peers[0], "10.0.0.1:7") == ["peer", "--join", "10.0.0.1:7", "--advertise", "10.0.0.3"]
    assert plan.peer_command(plan.peers[1], "10.0.0.1:7") == ["peer", "--join", "10.0.0.1:7"]  # no address=: its own
    for own in (["--advertise", "10.9.9.9"], ["--advertise=10.9.9.9"]):
        mine = plan_launch([Host("b", slots=1, address="10.0.0.3")], peer_args=own)
        assert mine.peer_command(mine.peers[0], "10.0.0.1:7") == ["peer", "--join", "10.0.0.1:7", *own]


def test_an_unknown_placeholder_in_the_peer_arguments_is_named() -> None:
    plan = plan_launch([Host("a")], peer_args=["--metrics", "{rank}.jsonl"])
    with pytest.raises(ConfigError, match=r"peer arguments: unknown placeholder \{rank\} \(known: \{index\}, \{host\}\)"):
        plan.peer_command(plan.peers[0], "a:1")


def test_the_ssh_template_puts_each_host_where_it_says() -> None:
    host = Host("alice@node2")
    assert ssh_prefix("ssh {host}", host) == ["ssh", "alice@node2"]
    assert ssh_prefix("ssh -o BatchMode=yes -l {user} {hostname}", host) == ["ssh", "-o", "BatchMode=yes", "-l", "alice", "node2"]
    assert ssh_prefix("ip netns exec {host}", Host("gt-1-0")) == ["ip", "netns", "exec", "gt-1-0"]
    assert ssh_prefix("ssh -o 'ProxyCommand=ssh -W %h:%p bastion' {host}", host)[2] == "ProxyCommand=ssh -W %h:%p bastion"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("ssh node1", "must contain {host}"),
        ("", "--ssh must not be empty"),
        ("ssh {node}", r"unknown placeholder \{node\}"),
        ("ssh 'unclosed {host}", "No closing quotation"),
    ],
)
def test_a_bad_ssh_template_is_refused(template: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_ssh_template(template)


def test_words_split_as_a_shell_would_and_a_required_one_may_not_be_empty() -> None:
    assert split_words("'/opt/my venv/bin/python' -m gossiptrain", "--remote-command", required=True) == [
        "/opt/my venv/bin/python", "-m", "gossiptrain"]
    with pytest.raises(ConfigError, match="--remote-command must not be empty"):
        split_words("  ", "--remote-command", required=True)
    assert split_words("", "--coordinator-args") == []
    with pytest.raises(ConfigError, match="--coordinator-args \"'--steps\": No closing quotation"):
        split_words("'--steps", "--coordinator-args")


def test_host_port_brackets_ipv6_and_the_default_port_is_the_documented_one() -> None:
    assert host_port("10.0.0.1", 29400) == "10.0.0.1:29400"
    assert host_port("fe80::1", 1) == "[fe80::1]:1"
    assert DEFAULT_PORT == 29400


def test_an_agent_request_survives_any_argument_and_a_bad_one_is_named() -> None:
    request = AgentRequest(["peer", "--set", "a=b c", "it's \"quoted\" $HOME `x`"], "/work dir", {"A": "1"}, 3.0, gossiptrain=True)
    line = request.encode()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert AgentRequest.decode(line) == request
    for bad, message in [
        (b"", "missing or longer than"),
        (b"{not json\n", "not JSON"),
        (b"[1]\n", "not a JSON object"),
        (b'{"argv": []}\n', "argv must be a non-empty list"),
        (b'{"argv": ["x"], "cwd": 3}\n', "cwd must be a string"),
        (b'{"argv": ["x"], "env": {"A": 1}}\n', "env must map strings"),
        (b'{"argv": ["x"], "grace": -1}\n', "grace must be"),
        (b'{"argv": ["x"], "gossiptrain": 1}\n', "gossiptrain must be true or false"),
    ]:
        with pytest.raises(ConfigError, match=message):
            AgentRequest.decode(bad)


def test_control_and_report_lines_round_trip_and_nothing_else_reads_as_one() -> None:
    assert parse_control(control_line("INT")) == "INT" and parse_control(control_line("TERM")) == "TERM"
    assert parse_control(b"signal KILL\n") is None and parse_control(b"hello\n") is None
    with pytest.raises(ValueError):
        control_line("KILL")
    assert parse_report(started_report(4242)) == 4242
    assert parse_report("started pid 4242") is None  # a process's own output never reads as the agent's
    assert parse_report(f"{AGENT_MARK} started pid x") is None
