"""BYTEPS_LINK_RATE: partitions, credit and the unsent cap sized to a link."""
import pytest

from bps_tf.runtime import config


def sized(env):
    v = config.core_settings(env)
    return v["partition_bytes"], v["credit_bytes"], v["tcp_notsent_lowat"]


def test_unset_keeps_the_defaults_for_fast_links():
    assert sized({}) == (1048576, 0, 262144)   # credit 0: 8 partitions


@pytest.mark.parametrize("rate, expected", [
    # about 20 ms of the link in flight, 8 partitions of it, a 32nd unsent
    ("100mbit", (32768, 262144, 8192)),
    ("300mbit", (131072, 1048576, 32768)),
    ("1gbit", (262144, 2097152, 65536)),
    ("1000mbit", (262144, 2097152, 65536)),
    ("56kbit", (8192, 65536, 4096)),          # never below 64 KiB of credit
])
def test_a_slow_link_shrinks_partitions_and_credit(rate, expected):
    assert sized({"BYTEPS_LINK_RATE": rate}) == expected


@pytest.mark.parametrize("rate", ["10gbit", "25gbit", "100gbit", "2.5gbit"])
def test_a_fast_link_gets_the_defaults_sizes(rate):
    # 8 partitions of 1 MiB: the same as the defaults' credit of 0.
    assert sized({"BYTEPS_LINK_RATE": rate}) == (1048576, 8388608, 262144)


def test_a_variable_set_explicitly_wins():
    env = {"BYTEPS_LINK_RATE": "100mbit", "BYTEPS_PARTITION_BYTES": "65536",
           "BYTEPS_TCP_NOTSENT_LOWAT": "0"}
    assert sized(env) == (65536, 262144, 0)
    env = {"BYTEPS_LINK_RATE": "100mbit", "BYTEPS_SCHEDULING_CREDIT": "0"}
    assert sized(env) == (32768, 0, 8192)


def test_the_credit_holds_at_least_one_explicit_partition():
    env = {"BYTEPS_LINK_RATE": "100mbit", "BYTEPS_PARTITION_BYTES": "1048576"}
    assert sized(env) == (1048576, 1048576, 8192)


@pytest.mark.parametrize("text", ["fast", "100", "-1gbit", "0mbit", "nanmbit", "infgbit",
                                  "1 gbps", "gbit"])
def test_a_rate_that_is_not_one_is_refused_with_examples(text):
    with pytest.raises(ValueError, match=r"BYTEPS_LINK_RATE=.* is not valid: it must be a "
                                         r"link rate such as 100mbit"):
        config.core_settings({"BYTEPS_LINK_RATE": text})
