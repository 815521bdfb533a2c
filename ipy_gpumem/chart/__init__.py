"""The charts: the session's timeline and background sampler, plotly figures (figures/) with SVG pictures beside them (svg/), and the live plotly/HTML/widget/text views."""
