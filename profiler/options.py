"""profile-model's settings are declared with :mod:`artifacts.options` (the one mechanism every
command declares its options with; there because ``needles`` and ``artifacts`` do not import
``profiler``), re-exported here for the stages."""

from artifacts.options import Choice as Choice
from artifacts.options import Integer as Integer
from artifacts.options import Kind as Kind
from artifacts.options import ListOf as ListOf
from artifacts.options import Number as Number
from artifacts.options import Option as Option
from artifacts.options import OutputFile as OutputFile
from artifacts.options import Renamed as Renamed
from artifacts.options import Switch as Switch
from artifacts.options import Text as Text
from artifacts.options import resolve_settings as resolve_settings
