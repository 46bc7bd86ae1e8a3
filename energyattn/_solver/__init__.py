from ._descend import Descent as Descent, descend as descend
from ._sign import sign_descend as sign_descend
from ._solution import RESULTS as RESULTS, Solution as Solution
