"""ckptstage as a ``torch.distributed.checkpoint`` (DCP) storage backend.

```python
import torch.distributed.checkpoint as dcp
from ckptstage.dcp import LoadPlanner, Reader, SavePlanner, Writer

dcp.save(sd, storage_writer=Writer("run3", step), planner=SavePlanner())
dcp.async_save(sd, storage_writer=Writer("run3", step), planner=SavePlanner())
dcp.load(sd, storage_reader=Reader("run3"), planner=LoadPlanner())   # newest complete step
```

A DCP-saved step is in ckptstage's universal format (fragments by fqn), so
``Client.load`` reads it, and ``Reader`` reads steps saved with
``Client.save`` too. With :class:`SavePlanner` / :class:`LoadPlanner`
nothing is ever pickled or unpickled; DCP's default planners work as well.
"""

from ckptstage.dcp.planners import LoadPlanner, SavePlanner
from ckptstage.dcp.reader import Reader
from ckptstage.dcp.writer import Writer

__all__ = ["LoadPlanner", "Reader", "SavePlanner", "Writer"]
