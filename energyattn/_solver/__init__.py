from ._descend import Descent as Descent, descend as descend
from ._fixed_point import (
    AbstractAdjoint as AbstractAdjoint,
    AbstractFixedPointSolver as AbstractFixedPointSolver,
    Anderson as Anderson,
    ImplicitAdjoint as ImplicitAdjoint,
    PhantomAdjoint as PhantomAdjoint,
    Picard as Picard,
    UnrolledAdjoint as UnrolledAdjoint,
    fixed_point as fixed_point,
    minimise as minimise,
)
from ._local import local_forces as local_forces
from ._sign import sign_descend as sign_descend
from ._solution import RESULTS as RESULTS, Solution as Solution
