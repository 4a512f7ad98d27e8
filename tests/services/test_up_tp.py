"""`pdserve up` refuses tensor parallel sizes it cannot run, in one line, before starting anything."""
from tests.services.test_cli import one_line, pdserve
from pdserve.services.up import free_port


def test_up_refuses_tp_pools_in_disagg_mode(tiny_llama):
    rc, out, err, _ = pdserve("up", "--model", str(tiny_llama), "--mode", "disagg", "--prefill-tp", "2",
                              "--port", str(free_port()))
    line = one_line(err)
    assert rc == 2 and out == ""
    assert "--prefill-tp 2 with --mode disagg" in line and "not implemented yet" in line and "--decode-tp" not in line


def test_up_refuses_a_degree_the_heads_cannot_split(tiny_llama):
    rc, _, err, _ = pdserve("up", "--model", str(tiny_llama), "--mode", "colocated", "--tensor-parallel-size", "3",
                            "--port", str(free_port()))
    line = one_line(err)
    assert rc == 2
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in line and "D08" in line
