-- Q5's first stage: the bids on each auction in each sliding window of 10 s, every 2 s.
SELECT auction, (event_time // 2000000 - i) * 2000000 AS window_start, count(*) AS num
FROM bid, range(5) AS slides(i)
GROUP BY auction, window_start
