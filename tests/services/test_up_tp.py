"""`pdserve up` refuses tensor parallel sizes it cannot run, in one line, before starting anything."""
from pdserve.services.ports import free_port
from tests.services.test_cli import one_line, pdserve


def test_up_checks_each_pools_degree_in_disagg_mode(tiny_llama):
    """Pools may run different TP degrees (KV moves head slice by head slice); each must split the heads."""
    rc, out, err, _ = pdserve("up", "--model", str(tiny_llama), "--mode", "disagg", "--prefill-tp", "2",
                              "--decode-tp", "3", "--port", str(free_port()))
    line = one_line(err)
    assert rc == 2 and out == ""
    assert "--decode-tp 3" in line and "tensor_parallel_size=3" in line and "--prefill-tp" not in line


def test_up_refuses_a_degree_the_heads_cannot_split(tiny_llama):
    rc, _, err, _ = pdserve("up", "--model", str(tiny_llama), "--mode", "colocated", "--tensor-parallel-size", "3",
                            "--port", str(free_port()))
    line = one_line(err)
    assert rc == 2
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in line and "D08" in line
