"""Does a permuted device order crash on this GPU machine without ficco_jax (plain psum), or with
a ficco dma all_gather? Each in a child process; prints the exit status of each."""
import subprocess
import sys

CODE = {
    "plain_psum": "import jax,numpy as np,jax.numpy as jnp;from jax.sharding import Mesh,PartitionSpec as P\n"
                  "d=jax.local_devices();m=Mesh(np.array(d[1:]+d[:1]),('tp',))\n"
                  "f=jax.jit(jax.shard_map(lambda a: jax.lax.psum(a,'tp'),mesh=m,in_specs=P('tp'),out_specs=P('tp')))\n"
                  "print(float(f(jnp.ones((len(d)*2,4))).sum()))",
    "ficco_all_gather": "import jax,numpy as np,jax.numpy as jnp;from jax.sharding import Mesh,PartitionSpec as P\n"
                        "from ficco_jax import dma\nd=jax.local_devices();m=Mesh(np.array(d[1:]+d[:1]),('tp',))\n"
                        "f=jax.jit(jax.shard_map(lambda a: dma.all_gather(a,'tp',schedule='dma/direct/c1'),mesh=m,in_specs=P('tp'),out_specs=P('tp')))\n"
                        "print(float(f(jnp.ones((len(d)*2,4))).sum()))",
}
for name, code in CODE.items():
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(f"{name}: exit {p.returncode}; stdout {p.stdout.strip()[-80:]!r}; stderr tail {p.stderr.strip()[-300:]!r}")
